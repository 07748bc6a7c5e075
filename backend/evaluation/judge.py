"""The judge: any OpenAI-compatible chat endpoint compares two answers to the same held-out prompt (issue 20
item 5). A library module: `tuneboard eval` with do_judge (backend.evaluation.evaluate) and the task metric at every save
(eval_metric: judge) call it.

Each pair is asked twice, A first and then B first, to cancel the judge's position bias: a row is a win only
when both orders prefer A (the tuned model's answer), a loss when both prefer B (the base model's answer or
the reference), else a tie. An order whose reply has no parseable verdict line counts as a tie for that order
and is flagged (`unparsed`).

The win rate is (wins + ties / 2) / n over the n rows judged, and its 95% interval is the Wilson score interval
of that share with n trials (ties count half a success; z = 1.96): `wilson_interval`. A judge that gave a verdict
in fewer than MIN_VERDICT_SHARE of its replies measured nothing (its ties are its silence): no win rate, and the
report's `no_score` says so in one line (`tuneboard eval` fails on it, eval_metric judge scores that save with none).
`probe` asks one pair before the judging is needed (eval_metric judge: before training), so a refused key or a
judge that does not answer fails the run at its start.

The client, the key handling and the budget are the distill teacher's (backend.distill.teacher: Teacher,
read_api_key, Budget, the connect-time guard; backend.core.teacher_access for the web UI's policy): the key comes
from an environment variable or a key file, is sent only in the Authorization header and is never written
(the spec, the run folder, the logs). `max_requests` (retries included) stops the judging cleanly: a row is
started only while the budget still holds both its requests, the rows judged so far are reported and the
report says `complete: false`. A judge that answers none of the first requests (max(3, concurrency) rows failed
after their retries, none answered: an endpoint that is down, refuses connections, answers 5xx) ends the judging
there, as the distill teacher's does: the report keeps the count of failed rows (`failed`), the requests the
judge answered (`answered`) and the first error (`first_error`). Every answered request is cached in
`cache_dir` (one JSON file per request, named by the hash of the judge's URL, model and the exact messages:
the same prompt and answers asked of the same judge make no new request).
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from backend.core import teacher_access
from backend.core.atomic import write_text_atomic
from backend.distill.teacher import Budget, BudgetExhausted, Teacher, TeacherError, TeacherFatal, read_api_key

PROMPT_VERSION = 1   # in the cache key: a reworded judge prompt asks again
MIN_VERDICT_SHARE = 0.5  # of the replies in the rows judged: with fewer verdict lines the win rate is no score
Z95 = 1.959963984540054
REASON_CHARS = 1000  # of a judge's reply kept per order in the report
ORDERS = ("AB", "BA")  # AB: the tuned model's answer shown first (as A); BA: shown second (as B)
VERDICT_RE = re.compile(r"verdict\s*[:=]\s*[*_`\"'\[(]*\s*(A|B|tie)\b", re.IGNORECASE)

SYSTEM_PROMPT = (
    "You are an impartial judge. You see a conversation and two candidate answers to its last user turn, "
    "<answer_a> and <answer_b>. Decide which answer is better: more correct, more helpful, closer to what the "
    "user asked for, in the format the user asked for. Ignore the answers' order and length as such.\n"
    "Reply with one or two sentences of reasoning, then a last line exactly `Verdict: A`, `Verdict: B` or "
    "`Verdict: tie`.")


class JudgeFatal(ValueError):
    """The judge cannot answer any pair (a refused key, an unknown model, an endpoint the UI may not use):
    one line saying why."""


@dataclass
class JudgeSettings:
    """Where the judge is and what it may spend. `cache_dir` None: no cache."""
    url: str
    model: str
    api_key_env: str | None = "OPENAI_API_KEY"
    api_key_file: str | None = None
    max_requests: int = 0            # 0 = no limit
    cache_dir: Path | None = None
    timeout: float = 120.0
    max_retries: int = 3
    backoff: float = 1.0
    max_tokens: int = 256
    concurrency: int = 4

    @classmethod
    def from_spec(cls, spec, cache_dir: str | Path | None = None) -> "JudgeSettings":
        """A RunSpec's judge_* keys (judge_url, judge_model, judge_api_key_env, judge_api_key_file,
        judge_max_requests)."""
        return cls(url=spec.judge_url or "", model=spec.judge_model or "", api_key_env=spec.judge_api_key_env,
                   api_key_file=spec.judge_api_key_file, max_requests=spec.judge_max_requests,
                   cache_dir=Path(cache_dir) if cache_dir else None)


# ------------------------------------------------------------------------------------ the pieces
def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of the share successes / n (successes may be fractional: a tie is half a
    win); (0, 1) when n is 0."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def parse_verdict(text: str) -> str | None:
    """'A', 'B' or 'tie' from the reply's last `Verdict: ...` line; None when there is none."""
    found = VERDICT_RE.findall(text or "")
    if not found:
        return None
    word = found[-1].lower()
    return "tie" if word == "tie" else word.upper()


def render_conversation(messages: list[dict]) -> str:
    return "\n\n".join(f"[{m.get('role', 'user')}]\n{m.get('content', '')}" for m in messages)


def judge_messages(prompt: list[dict], first: str, second: str) -> list[dict]:
    """The two chat messages one order sends: the instructions, then the conversation and both answers."""
    user = (f"<conversation>\n{render_conversation(prompt)}\n</conversation>\n\n"
            f"<answer_a>\n{first}\n</answer_a>\n\n<answer_b>\n{second}\n</answer_b>")
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def cache_key(settings: JudgeSettings, messages: list[dict]) -> str:
    try:
        url = teacher_access.normalize_url(settings.url)
    except ValueError:
        url = settings.url
    blob = json.dumps({"url": url, "model": settings.model, "messages": messages, "max_tokens": settings.max_tokens,
                       "version": PROMPT_VERSION}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def check_access(settings: JudgeSettings) -> None:
    """For a process the web UI started (teacher_access.restricted()): the UI's checks once more (the key's
    variable offered for this URL, a key file in the allowed folders, no internal address unless allowed).
    JudgeFatal names every refusal; a command-line run passes."""
    if not teacher_access.restricted():
        return
    refused = teacher_access.endpoint_refusals(settings.url, settings.api_key_env, settings.api_key_file, "judge",
                                               url_field="judge_url")
    if refused:
        raise JudgeFatal("; ".join(str(r) for r in refused))


# the distill teacher's messages name its spec keys; a judge's failure names the judge's
_TEACHER_WORDS = (("teacher_api_key_env", "judge_api_key_env"), ("teacher_api_key_file", "judge_api_key_file"),
                  ("teacher_model", "judge_model"), ("set teacher to", "set judge_url to"),
                  ("check teacher (the base URL", "check judge_url (the base URL"), ("teacher ", "judge "),
                  ("teacher:", "judge:"))


def judge_words(message: str) -> str:
    """A backend.distill.teacher message with the judge's key names instead of the teacher's."""
    for teacher, judge in _TEACHER_WORDS:
        message = message.replace(teacher, judge)
    return message


def _guarded(settings: JudgeSettings) -> bool:
    if not teacher_access.restricted():
        return False
    try:
        return teacher_access.normalize_url(settings.url) not in teacher_access.allowed_urls()
    except ValueError:
        return True


PROBE_PROMPT = [{"role": "user", "content": "Is the sky blue on a clear day? Answer yes or no."}]


def probe(settings: JudgeSettings, log=print) -> str | None:
    """One pair asked of the judge before it is needed (eval_metric judge: before training starts), so that a
    refused key, an unknown model or an endpoint that does not answer fails the run at its start with one line
    naming judge_url or the key's variable, not at the first save. Not cached, not counted in judge_max_requests.
    Returns the reply's verdict (None: the reply has no verdict line). JudgeFatal says why it failed."""
    check_access(settings)
    try:
        api_key = read_api_key(settings.api_key_env, settings.api_key_file)
    except OSError as exc:
        raise JudgeFatal(f"judge_api_key_file {settings.api_key_file}: {exc.strerror or exc}") from None
    client = Teacher(settings.url, settings.model, api_key, timeout=settings.timeout, max_retries=settings.max_retries,
                     backoff=settings.backoff, temperature=0.0, max_tokens=settings.max_tokens, budget=Budget(0),
                     log=lambda message: log(judge_words(message)), guard=_guarded(settings))
    try:
        reply = client.ask(judge_messages(PROBE_PROMPT, "Yes.", "No."))
    except TeacherFatal as exc:
        message = judge_words(str(exc))
        if re.search(r"HTTP 40[13]\b", message):  # the key was refused: which one
            message += f"; {_key_sent(settings, api_key)}"
        raise JudgeFatal(message) from None
    except TeacherError as exc:
        raise JudgeFatal(f"judge_url {settings.url}: no answer to a test request: {judge_words(str(exc))}") from None
    finally:
        client.close()
    return parse_verdict(reply.text)


def _key_sent(settings: JudgeSettings, api_key: str | None) -> str:
    if settings.api_key_file:
        return (f"the key sent was the first line of judge_api_key_file {settings.api_key_file}" if api_key
                else f"no key was sent (judge_api_key_file {settings.api_key_file} is empty)")
    if api_key:
        return f"the key sent was ${settings.api_key_env} (judge_api_key_env)"
    return f"no key was sent (${settings.api_key_env} is not set)" if settings.api_key_env else "no key was sent"


# ---------------------------------------------------------------------------------------- judging
def judge_pairs(prompts: list[list[dict]], answers_a: list[str], answers_b: list[str], settings: JudgeSettings,
                log=print, stop=lambda: False, progress=None) -> dict:
    """Every pair asked in both orders -> the report (see summarize). Never raises for the judge's failures:
    a refused key or another fatal reply ends the judging with `error` set (the rows judged before it are
    kept); `progress(rows_done, rows_total)` after each row."""
    if not (len(prompts) == len(answers_a) == len(answers_b)):
        raise ValueError(f"judge: {len(prompts)} prompts, {len(answers_a)} answers A, {len(answers_b)} answers B")
    rows = [{"index": i, "prompt": prompts[i], "a": answers_a[i], "b": answers_b[i], "orders": [],
             "verdict": "not judged"} for i in range(len(prompts))]
    budget = Budget(settings.max_requests)
    state = {"fatal": None, "spent": False, "failed": 0, "cached": 0, "done": 0, "reserved": 0, "answered": 0,
             "first_error": None, "dead": None}
    lock = threading.Lock()
    try:
        check_access(settings)
    except JudgeFatal as exc:
        state["fatal"] = str(exc)
        return summarize(rows, settings, budget, state)
    api_key = read_api_key(settings.api_key_env, settings.api_key_file)
    if api_key is None:
        log(f"judge: no API key (${settings.api_key_env} is not set)" if settings.api_key_env and
            not settings.api_key_file else "judge: no API key")
    stopped = lambda: bool(stop() or state["fatal"] or state["dead"])  # noqa: E731
    client = Teacher(settings.url, settings.model, api_key, timeout=settings.timeout, max_retries=settings.max_retries,
                     backoff=settings.backoff, temperature=0.0, max_tokens=settings.max_tokens, budget=budget,
                     stop=stopped, log=lambda message: log(judge_words(message)), guard=_guarded(settings))
    if settings.cache_dir:
        Path(settings.cache_dir).mkdir(parents=True, exist_ok=True)

    def cached_reply(messages: list[dict]) -> str | None:
        if not settings.cache_dir:
            return None
        try:
            path = Path(settings.cache_dir) / f"{cache_key(settings, messages)}.json"
            return str(json.loads(path.read_text(encoding="utf-8"))["text"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def ask(messages: list[dict]) -> tuple[str, bool]:
        """(reply text, from the cache)."""
        hit = cached_reply(messages)
        if hit is not None:
            return hit, True
        cached = Path(settings.cache_dir) / f"{cache_key(settings, messages)}.json" if settings.cache_dir else None
        answer = client.ask(messages)
        with lock:
            state["answered"] += 1
        if cached is not None:
            write_text_atomic(cached, json.dumps({"text": answer.text, "finish_reason": answer.finish_reason,
                                                  "model": settings.model}, ensure_ascii=False))
        return answer.text, False

    def work(row: dict) -> None:
        asks = {order: judge_messages(row["prompt"], *((row["a"], row["b"]) if order == "AB" else (row["b"], row["a"])))
                for order in ORDERS}
        needed = len({json.dumps(m) for m in asks.values() if cached_reply(m) is None})
        with lock:  # a row is started only when the budget still holds both its requests
            if budget.limit and state["reserved"] + needed > budget.limit:
                state["spent"] = True
                return
            state["reserved"] += needed
        orders = []
        for order in ORDERS:
            if stopped():
                return
            try:
                text, hit = ask(asks[order])
            except BudgetExhausted:
                with lock:
                    state["spent"] = True
                return
            except TeacherFatal as exc:
                with lock:
                    state["fatal"] = state["fatal"] or judge_words(str(exc))
                return
            except TeacherError as exc:
                if stopped():  # a stop (or a fatal reply, or a judge that answers nothing) cut its retries short
                    return
                message = judge_words(str(exc))
                with lock:
                    state["failed"] += 1
                    state["first_error"] = state["first_error"] or message
                    if not state["answered"] and not state["dead"] and state["failed"] >= max(3, settings.concurrency):
                        state["dead"] = (f"the judge answered none of the first {state['failed']} rows' requests; "
                                         f"first error: {state['first_error']}")
                row["error"] = message
                return
            verdict = parse_verdict(text)
            prefers = "tie" if verdict in (None, "tie") else ("a" if (verdict == "A") == (order == "AB") else "b")
            orders.append({"order": order, "verdict": verdict or "tie", "parsed": verdict is not None,
                           "prefers": prefers, "cached": hit, "reason": _clip(text.strip(), REASON_CHARS)})
            if hit:
                with lock:
                    state["cached"] += 1
        row["orders"] = orders
        prefs = {o["prefers"] for o in orders}
        row["verdict"] = "win" if prefs == {"a"} else "loss" if prefs == {"b"} else "tie"
        with lock:
            state["done"] += 1
            done = state["done"]
        if progress:
            progress(done, len(rows))

    try:
        with ThreadPoolExecutor(max_workers=max(1, settings.concurrency), thread_name_prefix="judge") as pool:
            for future in [pool.submit(work, row) for row in rows]:
                future.result()
    finally:
        client.close()
    return summarize(rows, settings, budget, state, stop_reason=stop() or None)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def summarize(rows: list[dict], settings: JudgeSettings, budget: Budget, state: dict, stop_reason=None) -> dict:
    """The report: counts, win rate and its interval, each row with both orders' verdicts and reasons. A judge that
    gave a verdict in fewer than MIN_VERDICT_SHARE of its replies (each reply without one a tie) gives no win rate
    (None): `no_score` says why in one line."""
    judged = [r for r in rows if r["verdict"] != "not judged"]
    wins = sum(r["verdict"] == "win" for r in judged)
    ties = sum(r["verdict"] == "tie" for r in judged)
    losses = sum(r["verdict"] == "loss" for r in judged)
    n = len(judged)
    replies = [o for r in judged for o in r["orders"]]
    unparsed = sum(not o["parsed"] for o in replies)
    no_score = None
    if replies and len(replies) - unparsed < MIN_VERDICT_SHARE * len(replies):
        no_score = (f"no win rate: the judge gave a verdict in {len(replies) - unparsed} of its {len(replies)} replies "
                    f"(fewer than {MIN_VERDICT_SHARE:.0%}; a reply must end with a line `Verdict: A`, `Verdict: B` or "
                    "`Verdict: tie`): check judge_model")
    rate = (wins + ties / 2) / n if n and not no_score else None
    low, high = wilson_interval(wins + ties / 2, n) if rate is not None else (None, None)
    stopped = None
    if state["fatal"]:
        stopped = state["fatal"]
    elif stop_reason:
        stopped = f"stopped ({stop_reason})"
    elif state.get("dead"):
        stopped = state["dead"]
    elif state["spent"]:
        stopped = f"judge_max_requests {settings.max_requests} spent"
    elif state["failed"]:
        stopped = f"{state['failed']} rows failed at the judge after their retries (run again to retry them)"
    return {"judge_url": settings.url, "judge_model": settings.model, "rows": len(rows), "judged": n,
            "wins": wins, "ties": ties, "losses": losses, "win_rate": rate, "interval": [low, high],
            "interval_method": "Wilson score interval, 95%, of (wins + ties/2) / judged rows",
            "unparsed": unparsed, "no_score": no_score,
            "requests": budget.used, "cached": state["cached"], "max_requests": settings.max_requests,
            "answered": state.get("answered", 0), "failed": state["failed"], "first_error": state.get("first_error"),
            "complete": n == len(rows), "stopped": stopped, "error": state["fatal"], "per_row": rows}


def summary_line(report: dict) -> str:
    """One line: W/T/L, the win rate with its interval, requests, and why it is incomplete."""
    if not report.get("judged"):
        head = f"judge: no row judged of {report.get('rows', 0)}"
    elif report.get("no_score"):
        head = f"judge: {report['no_score']}"
    else:
        low, high = report["interval"]
        head = (f"judge: {report['wins']} wins, {report['ties']} ties, {report['losses']} losses of "
                f"{report['judged']} rows; win rate {report['win_rate']:.3f} (95% interval {low:.3f}-{high:.3f})")
    head += f"; {report.get('requests', 0)} requests, {report.get('cached', 0)} answers from the cache"
    if report.get("unparsed") and not report.get("no_score"):
        head += f"; {report['unparsed']} replies without a verdict line (counted as ties)"
    if not report.get("complete"):
        head += f"; incomplete: {report.get('stopped') or 'not every row was judged'}"
    return head


def judge_win_rate(prompts: list[list[dict]], candidates: list[str], references: list[str],
                   settings: JudgeSettings, log=print) -> float:
    """The task metric `judge`: the candidates' (the tuned model's answers) win rate against the references,
    (wins + ties/2) / rows judged, each pair asked in both orders. A spent budget gives the rate over the rows
    judged (logged as incomplete); JudgeFatal when the judge refuses (a refused key: one line); NaN when no
    row could be judged or too few replies had a verdict (summarize's no_score): no score for this save."""
    report = judge_pairs(prompts, candidates, references, settings, log=log)
    log(summary_line(report))
    if report["error"]:
        raise JudgeFatal(report["error"])
    return float("nan") if report["win_rate"] is None else float(report["win_rate"])
