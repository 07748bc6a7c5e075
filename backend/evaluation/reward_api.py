"""A reward model behind an HTTP endpoint (`reward_model_type: api`, LLaMA-Factory's convention): each rollout
batch's texts (the prompt's conversation + the response, rendered by the policy's template as the reward model
sees them, special tokens kept) go in ONE request,

    POST {reward_model}/v1/score/evaluation   {"model": "model", "messages": [text, ...]}
    -> {"scores": [float, ...]}                (one per text, in order)

with `Authorization: Bearer KEY` when a key is configured. `tuneboard api --reward-model RM_RUN` answers that
route (backend.serving.api), as LLaMA-Factory's API server does for a reward model.

The key is read at run time from the environment variable named by reward_model_api_key_env or the file named by
reward_model_api_key_file (backend.distill.teacher.read_api_key, the distill teacher's rule): never a spec key,
never written to the run folder or the log; error messages have it replaced by ***. No redirect is followed (the
key goes to the URL it was configured for only). A timeout, a refused connection, an HTTP error or a malformed
answer is one RewardError line naming the URL (and the status): stage ppo turns it into a failed run.

Light module (httpx, json): the reward model's weights are the server's business.
"""
from __future__ import annotations

import json

import httpx

from backend.core import teacher_access
from backend.core.rewards import RewardError
from backend.dataprep.preference import scored_ids

SCORE_ROUTE = "/v1/score/evaluation"
REQUEST_TIMEOUT_S = 300.0  # one request scores a whole rollout batch; a slow server is not a dead one
MODEL_NAME = "model"  # what LLaMA-Factory's client sends; `tuneboard api` serving one reward model takes any name


def score_url(base: str) -> str:
    """The scoring route of `base`: http://host:port, http://host:port/v1 or the full route itself."""
    url = str(base).strip().rstrip("/")
    if url.endswith(SCORE_ROUTE):
        return url
    if url.endswith("/v1"):
        url = url[:-3]
    return url + SCORE_ROUTE


class ApiReward:
    """A reward function (the signature stage ppo's Scorer calls, TRL's) that asks a scoring endpoint: renders each
    row's conversation + completion with `template` (the policy's), cut to cutoff_len as an rm run cuts its pairs,
    decodes the ids with their special tokens, and posts all texts of the call in one request."""

    def __init__(self, url: str, api_key: str | None, *, template, tokenizer, cutoff_len: int | None,
                 name: str = "reward_model", timeout: float = REQUEST_TIMEOUT_S, transport=None):
        self.__name__ = name  # the metric is rewards/<name>/mean
        self.url = score_url(url)
        self.template, self.tokenizer, self.cutoff_len = template, tokenizer, cutoff_len
        self._secret = api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # follow_redirects=False (httpx's default, said out loud): the key goes to this URL and nowhere else
        self.client = httpx.Client(headers=headers, timeout=timeout, follow_redirects=False, transport=transport)

    def close(self) -> None:
        self.client.close()

    def texts(self, completions: list[str], conversation: list[str]) -> list[str | None]:
        """The text the reward model scores for each completion; None where the template renders no answer."""
        out: list[str | None] = []
        for row, completion in zip(conversation, completions):
            ids = scored_ids(json.loads(row), completion, self.template, self.tokenizer, self.cutoff_len)
            out.append(None if ids is None else self.tokenizer.decode(ids, skip_special_tokens=False))
        return out

    def __call__(self, prompts, completions, conversation=None, **kwargs) -> list[float | None]:
        if conversation is None:
            raise RewardError(f"reward_model {self.url}: the rows carry no conversation to render")
        texts = self.texts(completions, conversation)
        given = [t for t in texts if t is not None]
        scores = iter(self.score(given) if given else [])
        return [next(scores) if t is not None else None for t in texts]

    def score(self, texts: list[str]) -> list[float]:
        """One request: the endpoint's score of each text. RewardError (one line naming the URL) otherwise."""
        where = f"reward_model {self.url}"
        try:
            r = self.client.post(self.url, json={"model": MODEL_NAME, "messages": texts})
        except httpx.TimeoutException:
            raise RewardError(f"{where}: no answer within {self.client.timeout.read:g} s") from None
        except httpx.HTTPError as exc:
            raise RewardError(self._redact(f"{where}: cannot reach it ({type(exc).__name__}: {exc})")) from None
        if r.status_code != 200:
            hint = {401: " (the key was refused: check reward_model_api_key_env or reward_model_api_key_file)",
                    404: " (no such route or model: is it a `tuneboard api --reward-model` server?)"}
            message = teacher_access.error_line(r.content, r.reason_phrase)
            raise RewardError(self._redact(f"{where}: HTTP {r.status_code}: {message}"
                                           + hint.get(r.status_code, "")))
        try:
            scores = [float(s) for s in r.json()["scores"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise RewardError(f"{where}: the answer has no list of numbers under 'scores' ({exc})") from None
        if len(scores) != len(texts):
            raise RewardError(f"{where}: {len(scores)} scores for {len(texts)} texts")
        return scores

    def _redact(self, text: str) -> str:
        return text.replace(self._secret, "***") if self._secret else text
