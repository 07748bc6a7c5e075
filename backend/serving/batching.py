"""Continuous batching for the transformers backend (`tuneboard api`, Chat): the requests on one loaded model
share its decode steps. A request joins the running batch as soon as it arrives (its prompt is prefilled on
its own, its KV cache padded on the left to the batch's length and stacked in), every step then decodes one
token for every request in one forward pass, and a request leaves the batch the step it ends (end of turn,
stop string, max_new_tokens, stop_event, time limit), its rows dropped from the cache.

Why our own loop and not transformers' continuous batching (generation/continuous_batching, `generate_batch`):
that manager takes one GenerationConfig for all its requests and switches the model's attention to its paged
form, and it has no stop strings, per-request stopping criteria or per-request peft adapter; ours keeps each
request's own sampling settings, seed, stopping criteria and streamer, exactly as `generate` ran them.

Each request keeps its own logits processors (repetition penalty; OpenAI's frequency and presence penalties and
logit_bias, TokenPenalties, only where the request sets one; temperature, top-k, top-p when sampling), in the order
`generate` applies them, and, when seeded, its own random generator seeded as `generate` would be after
torch.manual_seed(seed), so a request's answer is the one it gets alone. Requests of different adapters of one base
take turns by batch: the batch holds one adapter state at a time, and a request of another waits until the batch in
front of it has drained (first come, first served). Each step holds the model's TurnLock, so scoring and other engines
on the model interleave between steps. Only models whose cache is plain full attention are batched
(`batchable`); the others keep `generate` in turns.

A chat's next turn reuses the KV cache of the turn before (TUNEBOARD_KV_REUSE=0 turns this off: side-by-side
measurements, bench/serving.py). When a row leaves the batch, its K/V (without the left padding: the prompt and the
answer but its last token, which was never fed back) is saved in a small store (KVStore: LRU, KV_ENTRIES entries,
KV_BYTES in all) keyed by the adapter state and those token ids. A request whose prompt starts with at least
KV_MIN_REUSE of an entry's tokens (a chat's next turn: the previous prompt and answer, then the new message; or a
shared system prompt) is prefilled from there only, on a copy of that entry's K/V cut to the common prefix. Keys
and values at a position depend only on the tokens up to it, so a prefix that matches token for token gives what a
full prefill gives (as batching does, up to float rounding; the tests check the answers); a template that renders
earlier turns differently matches less, or not at all, and is prefilled in full. The store belongs to the Batcher,
that is to one loaded model, and lives as long as it (an idle loop keeps it for the next turn).

`Batcher.stats` counts steps and the largest batch, and the reuse: `kv_hits`, `kv_misses` (requests prefilled on a
saved prefix, or in full), `kv_reused_tokens` (prompt tokens not prefilled again), `kv_prefilled_tokens` (prompt
tokens prefilled), for the server's /health and the tests. Nothing is logged per request.
"""
from __future__ import annotations

import atexit
import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

MAX_BATCH = 16  # requests decoded together; more wait for a free row
IDLE_S = 30.0  # an idle loop ends after this long (its thread lets go of the model); the next request starts it anew
KV_ENTRIES = 8  # finished rows whose KV cache is kept for a chat's next turn (least recently used goes first)
KV_BYTES = 256 << 20  # and their K/V tensors in all (an entry over it is not kept)
KV_MIN_REUSE = 16  # prompt tokens in common with an entry below which the prompt is prefilled in full
_LIVE: "weakref.WeakSet[Batcher]" = weakref.WeakSet()


def batchable(model) -> bool:
    """Whether the model's KV cache is plain full attention in every layer (what the batch pads and stacks).
    TUNEBOARD_BATCHING=0 in the environment turns batching off (turns instead: side-by-side measurements, bench/)."""
    if os.environ.get("TUNEBOARD_BATCHING", "1") == "0":
        return False
    config = getattr(model, "config", None)
    if config is None:
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "is_encoder_decoder", False):
        return False
    types = getattr(text, "layer_types", None)
    if types is not None:
        return all(t == "full_attention" for t in types)
    return not (getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True))


def kv_reuse() -> bool:
    """Whether a prompt may be prefilled on a saved prefix's KV cache; TUNEBOARD_KV_REUSE=0 turns it off."""
    return os.environ.get("TUNEBOARD_KV_REUSE", "1") != "0"


def common_prefix(a, b) -> int:
    """How many leading tokens `a` and `b` share (lists or tuples)."""
    a, b = tuple(a), tuple(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]: halve (slices compare in C)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class KVStore:
    """Finished rows' KV caches, keyed by (adapter state, token ids): each entry a list of one (keys, values)
    pair per layer, shaped [1, heads, len(ids), head_dim]. Used by the batch loop's thread only."""

    def __init__(self, entries: int = KV_ENTRIES, max_bytes: int = KV_BYTES):
        self.entries, self.max_bytes = entries, max_bytes
        self._items: "OrderedDict[tuple, tuple[list, int]]" = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, state: Any, ids: list[int], layers: list) -> None:
        size = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
        if size > self.max_bytes or not ids:
            return
        ids = tuple(ids)
        for key in [key for key in self._items if key[0] == state and key[1] == ids[:len(key[1])]]:
            self._pop(key)  # a prefix of this one (the chat's earlier turn): this entry serves all it served
        self._items[(state, ids)] = (layers, size)
        self.bytes += size
        while len(self._items) > self.entries or self.bytes > self.max_bytes:
            self._pop(next(iter(self._items)))

    def get(self, state: Any, ids: list[int]) -> tuple[int, list | None]:
        """The longest saved prefix of `ids` (in tokens) and its entry's layers (None when nothing matches)."""
        best, found, hit = 0, None, None
        ids = tuple(ids)
        for key, (layers, _) in self._items.items():
            if key[0] != state:
                continue
            n = common_prefix(key[1], ids)
            if n > best:
                best, found, hit = n, layers, key
        if hit is not None:
            self._items.move_to_end(hit)
        return best, found

    def _pop(self, key) -> None:
        self.bytes -= self._items.pop(key)[1]


def make_roomy(cache) -> None:
    """Make the cache's plain layers grow in place (RoomyLayer) instead of by concatenation, from its next update."""
    roomy = _roomy_layer_class()
    for i, layer in enumerate(cache.layers):
        if type(layer) is roomy.__base__:
            grown = roomy()
            grown.__dict__.update(layer.__dict__)
            cache.layers[i] = grown


_ROOMY = None


def _roomy_layer_class():
    """RoomyLayer, made on first use (its base class is transformers', which the module top does not import).

    transformers' DynamicLayer appends a step's keys and values with torch.cat, which copies the whole cache of
    the layer every decode step: at 32 rows x 700 positions of a 30-layer model that is ~1 GB written per step, most
    of a CPU decode step's time (bench/README.md, scoring). A RoomyLayer keeps its keys and values in a buffer with
    spare positions and writes each step's into it; the layer's `keys` / `values` are views of the buffer. When the
    batch replaces them (a row joins or leaves: Batcher._join, _drop) the next update copies them into a new buffer,
    once. Same numbers as concatenation (the same values at the same positions)."""
    global _ROOMY
    if _ROOMY is None:
        # heavy (transformers): the module top stays light
        from transformers.cache_utils import DynamicLayer

        class RoomyLayer(DynamicLayer):
            SPARE = 256  # positions added beyond what is needed when the buffer grows (and a quarter more)

            def update(self, key_states, value_states, *args, **kwargs):
                if not self.is_initialized:
                    self.lazy_initialization(key_states, value_states)
                n = self.keys.shape[-2] if self.keys.numel() else 0
                t = key_states.shape[-2]
                buffers = getattr(self, "_buffers", None)
                views = getattr(self, "_views", (None, None))
                if buffers is None or views[0] is not self.keys or views[1] is not self.values \
                        or buffers[0].shape[-2] < n + t or buffers[0].shape[:2] != key_states.shape[:2]:
                    room = n + t + (n + t) // 4 + self.SPARE
                    buffers = []
                    for old, new in ((self.keys, key_states), (self.values, value_states)):
                        buf = new.new_empty((*new.shape[:2], room, new.shape[-1]))
                        if n:
                            buf[:, :, :n] = old
                        buffers.append(buf)
                    self._buffers = buffers
                self._buffers[0][:, :, n:n + t] = key_states
                self._buffers[1][:, :, n:n + t] = value_states
                self.keys, self.values = self._buffers[0][:, :, :n + t], self._buffers[1][:, :, :n + t]
                self._views = (self.keys, self.values)
                return self.keys, self.values

        _ROOMY = RoomyLayer
    return _ROOMY


class TokenPenalties:
    """OpenAI's frequency_penalty, presence_penalty and logit_bias as a logits processor of one request (one row):
    logits[j] += bias[j] - c[j] * frequency - (c[j] > 0) * presence, where c[j] counts token j among the tokens
    generated so far (those after the first `prompt_len`: the prompt is not counted). The counts grow with each call
    (the row's sequence is one token longer each step), so a step costs a few vocabulary-sized operations, whatever
    the answer's length. Used by the batch (Job.processors) and by `generate` (engine.HFEngine), after the repetition
    penalty and before temperature, top-k and top-p, as `generate` orders its own; only where `wanted`."""

    def __init__(self, prompt_len: int, frequency: float = 0.0, presence: float = 0.0,
                 bias: dict[int, float] | None = None):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence
        self.bias = dict(bias or {})
        self._counts = self._bias = None
        self._seen = prompt_len

    @staticmethod
    def wanted(frequency: float, presence: float, bias: dict | None) -> bool:
        """Whether these values change any logit (the default request's do not: it gets no processor)."""
        return bool(frequency or presence or any(bias.values() if bias else ()))

    def __call__(self, input_ids, scores):
        # heavy (torch): the module top stays light
        import torch

        if self._counts is None or input_ids.shape[1] < self._seen:  # first call (or another sequence): count anew
            self._counts = torch.zeros(scores.shape[-1], dtype=scores.dtype, device=scores.device)
            self._seen = self.prompt_len
        if self._bias is None:
            self._bias = torch.zeros(scores.shape[-1], dtype=scores.dtype, device=scores.device)
            if self.bias:
                self._bias[torch.tensor(list(self.bias), device=scores.device)] = torch.tensor(
                    list(self.bias.values()), dtype=scores.dtype, device=scores.device)
        new = input_ids[0, self._seen:]
        if new.numel():
            self._counts.index_add_(0, new.to(self._counts.device), torch.ones_like(new, dtype=self._counts.dtype))
            self._seen = input_ids.shape[1]
        return scores - self._counts * self.frequency - (self._counts > 0) * self.presence + self._bias


@dataclass
class Job:
    """One request in the batcher. `criteria` (engine._Criteria) is called with the request's ids after each
    token; `streamer` (a transformers streamer) gets the prompt, then each token, then end()."""

    ids: list[int]
    state: Any  # the engine's adapter state, the batch's key
    activate: Callable[[], None]
    max_new_tokens: int
    eos_ids: list[int]
    criteria: Any
    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    streamer: Any = None
    tokens: list[int] = field(default_factory=list)
    started: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def processors(self):
        # heavy (torch, transformers): the module top stays light
        from transformers import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                  TopKLogitsWarper, TopPLogitsWarper)

        out = LogitsProcessorList()
        if self.repetition_penalty != 1.0:
            out.append(RepetitionPenaltyLogitsProcessor(self.repetition_penalty))
        if TokenPenalties.wanted(self.frequency_penalty, self.presence_penalty, self.logit_bias):
            out.append(TokenPenalties(len(self.ids), self.frequency_penalty, self.presence_penalty, self.logit_bias))
        if not self.greedy:
            if self.temperature != 1.0:
                out.append(TemperatureLogitsWarper(self.temperature))
            if self.top_k:
                out.append(TopKLogitsWarper(top_k=self.top_k, min_tokens_to_keep=1))
            if self.top_p < 1.0:
                out.append(TopPLogitsWarper(top_p=self.top_p, min_tokens_to_keep=1))
        return out


class Batcher:
    """The decode loop of one loaded model (a daemon thread, started on the first request, ended when idle
    for IDLE_S and at interpreter exit: a process whose last answer is out must not exit while the loop is
    still in a forward pass, which aborts it with "terminate called without an active exception")."""

    def __init__(self, model, lock, max_batch: int = MAX_BATCH, on_step: Callable[[], None] | None = None):
        self.model, self.lock, self.max_batch = model, lock, max_batch
        self.on_step = on_step  # called after each decode step (the scorer's decode-thread choice)
        self._cond = threading.Condition()
        self._pending: list[Job] = []
        self._thread: threading.Thread | None = None
        self._closing = False
        _LIVE.add(self)
        self.stats = {"steps": 0, "batched_steps": 0, "max_batch": 0, "requests": 0,
                      "kv_hits": 0, "kv_misses": 0, "kv_reused_tokens": 0, "kv_prefilled_tokens": 0}
        self.kv = KVStore()  # finished rows' KV caches, for a chat's next turn (kv_reuse)
        # the running batch: its jobs (rows), their KV cache, the attention mask over it (0 = left padding)
        self._rows: list[Job] = []
        self._state: Any = None
        self._cache = None
        self._mask = None
        self._procs: dict[int, Any] = {}
        self._rngs: dict[int, Any] = {}

    # -- callers' side
    def run(self, job: Job) -> bool:
        """Generate `job` in the batch; False when it ended (criteria.ended()) before its first token."""
        self.run_all([job])
        return job.started

    def run_all(self, jobs: list[Job]) -> None:
        """Generate all `jobs` (they join the batch in this order as rows free up); the first error is raised
        once every job has ended."""
        with self._cond:
            self._pending.extend(jobs)
            self.stats["requests"] += len(jobs)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="batcher", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        for job in jobs:
            job.done.wait()
        for job in jobs:
            if job.error is not None:
                raise job.error

    def close(self, timeout: float = 120.0) -> None:
        """End the loop after its current step (the requests still in it get an error) and wait for it."""
        with self._cond:
            self._closing = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def waiting(self) -> int:
        """How many requests wait to join the batch (a hint, read without the lock)."""
        return len(self._pending)

    # -- the loop
    def _loop(self) -> None:
        # heavy (torch): the module top stays light
        import torch

        while True:
            with self._cond:
                while not self._pending and not self._rows and not self._closing:
                    if not self._cond.wait(IDLE_S) and not self._pending:
                        self._thread = None  # idle: the next request starts a new loop
                        return
                if self._closing:
                    self._thread = None
                    for job in self._rows + self._pending:
                        self._end(job, RuntimeError("the server is shutting down"))
                    self._rows, self._pending, self._cache, self._mask = [], [], None, None
                    return
            self.lock.acquire()
            try:
                with torch.inference_mode():
                    self._step()
            except BaseException as exc:  # the batch's requests get the error; the loop goes on for the next ones
                for job in self._rows:
                    self._end(job, exc)
                self._rows, self._cache, self._mask = [], None, None
            finally:
                self.lock.release()

    def _admit(self) -> list[Job]:
        """Pending jobs that join now: first come first served, while they share the batch's adapter state."""
        joined = []
        with self._cond:
            while self._pending and len(self._rows) + len(joined) < self.max_batch:
                job = self._pending[0]
                if job.criteria.ended():  # left (or timed out) while waiting: nothing generated
                    self._pending.pop(0)
                    self._end(job)
                    continue
                state = self._state if self._rows or joined else job.state
                if job.state != state:
                    break
                self._state = state
                joined.append(self._pending.pop(0))
        return joined

    def _step(self) -> None:
        # heavy (torch, transformers): the module top stays light
        import torch

        joined = self._admit()
        if self._rows or joined:  # the model in the batch's adapter state (a score() between steps may have changed it)
            (self._rows or joined)[0].activate()
        for job in joined:
            try:
                self._prefill(job)
            except BaseException as exc:  # this request gets the error; the batch goes on
                self._forget(job)
                self._end(job, exc)
        if not self._rows:
            return
        rows = len(self._rows)
        self.stats["steps"] += 1
        self.stats["batched_steps"] += rows > 1
        self.stats["max_batch"] = max(self.stats["max_batch"], rows)
        device = self._mask.device
        last = torch.tensor([[job.tokens[-1]] for job in self._rows], device=device)
        mask = torch.cat([self._mask, torch.ones((rows, 1), dtype=self._mask.dtype, device=device)], dim=1)
        positions = mask.sum(dim=1, keepdim=True) - 1
        out = self.model(input_ids=last, attention_mask=mask, position_ids=positions, cache=self._cache,
                         use_cache=True)
        self._cache, self._mask = out.cache, mask
        logits = out.logits[:, -1].to(dtype=torch.float32)
        ended = [i for i, job in enumerate(self._rows) if not self._take(job, logits[i:i + 1])]
        self._drop(ended)
        if self.on_step is not None:
            self.on_step()

    def _prefill(self, job: Job) -> None:
        """The job's prompt on its own: its first token, then (unless that ended it) its cache joins the batch."""
        # heavy (torch, transformers): the module top stays light
        import torch

        device = self.model.device
        ids = torch.tensor([job.ids], device=device)
        cache, reused = self._reuse(job)
        if cache is None:
            out = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1)
        else:  # the new tokens on top of the saved prefix, at their own positions
            new = ids[:, reused:]
            out = self.model(input_ids=new, attention_mask=torch.ones_like(ids), cache=cache, use_cache=True,
                             position_ids=torch.arange(reused, ids.shape[1], device=device).unsqueeze(0),
                             logits_to_keep=1)
        self.stats["kv_prefilled_tokens"] += len(job.ids) - reused
        job.started = True
        if job.streamer is not None:
            job.streamer.put(ids.cpu())
        self._procs[id(job)] = job.processors()
        if job.seed is not None and not job.greedy:
            self._rngs[id(job)] = torch.Generator(device=device).manual_seed(job.seed)
        if not self._take(job, out.logits[:, -1].to(dtype=torch.float32)):
            self._forget(job)
            self._save(job, [(layer.keys, layer.values) for layer in out.cache.layers])
            return
        self._join(job, out.cache, ids.shape[1])

    def _reuse(self, job: Job):
        """A cache holding the K/V of the longest saved prefix of the job's prompt (at least KV_MIN_REUSE tokens,
        and one token short of the whole prompt at most: its last token gives the first logits), and its length;
        (None, 0) when there is none, or reuse is off."""
        if not kv_reuse():
            return None, 0
        n, layers = self.kv.get(job.state, job.ids)
        n = min(n, len(job.ids) - 1)
        if layers is None or n < KV_MIN_REUSE:
            self.stats["kv_misses"] += 1
            return None, 0
        # heavy (transformers): the module top stays light
        from transformers import DynamicCache

        # the update in DynamicCache's constructor concatenates: a copy, the saved entry stays as it is
        cache = DynamicCache(ddp_cache_data=[(k[:, :, :n], v[:, :, :n]) for k, v in layers],
                             config=self.model.config)
        self.stats["kv_hits"] += 1
        self.stats["kv_reused_tokens"] += n
        return cache, n

    def _save(self, job: Job, layers: list) -> None:
        """Keep a finished row's K/V (`layers`: one row, no padding; the job's prompt and all its tokens but the
        last, which was never fed back) for a later prompt that starts the same way."""
        if not kv_reuse():
            return
        ids = job.ids + job.tokens[:-1]
        if any(k.shape[-2] != len(ids) for k, _ in layers):  # not the plain layout the batch keeps: keep nothing
            return
        self.kv.put(job.state, ids, [(k.clone(), v.clone()) for k, v in layers])

    def _take(self, job: Job, logits) -> bool:
        """Choose the job's next token from its logits row; False once the job has ended (and is told so)."""
        # heavy (torch): the module top stays light
        import torch

        device = logits.device
        seq = torch.tensor([job.ids + job.tokens], device=device)
        scores = self._procs[id(job)](seq, logits)
        if job.greedy:
            token = int(torch.argmax(scores, dim=-1))
        else:
            probs = torch.softmax(scores, dim=-1)
            token = int(torch.multinomial(probs, num_samples=1, generator=self._rngs.get(id(job))))
        job.tokens.append(token)
        if job.streamer is not None:
            job.streamer.put(torch.tensor([token]))
        seq = torch.cat([seq, torch.tensor([[token]], device=device)], dim=1)
        stop = bool(job.criteria(seq)[0])
        if stop or token in job.eos_ids or len(job.tokens) >= job.max_new_tokens:
            self._end(job)
            return False
        return True

    def _join(self, job: Job, cache, length: int) -> None:
        """Stack the job's cache (one row, `length` long) into the batch's, padding the shorter on the left."""
        # heavy (torch): the module top stays light
        import torch

        mask = torch.ones((1, length), dtype=torch.long, device=self.model.device)
        if not self._rows:
            make_roomy(cache)
            self._rows, self._cache, self._mask = [job], cache, mask
            return
        have = self._mask.shape[1]
        width = max(have, length)
        for mine, theirs in zip(self._cache.layers, cache.layers):
            for name in ("keys", "values"):
                a, b = getattr(mine, name), getattr(theirs, name)
                a = _pad_left(a, width - a.shape[-2])
                b = _pad_left(b, width - b.shape[-2])
                setattr(mine, name, torch.cat([a, b], dim=0))
        self._mask = torch.cat([_pad_left(self._mask, width - have, dim=1), _pad_left(mask, width - length, dim=1)])
        self._rows.append(job)

    def _drop(self, ended: list[int]) -> None:
        """Take the ended rows out of the batch, and the left padding no row needs any more."""
        # heavy (torch): the module top stays light
        import torch

        if not ended:
            return
        keep = [i for i in range(len(self._rows)) if i not in set(ended)]
        width = self._mask.shape[1]
        for i in ended:
            self._forget(self._rows[i])
            start = width - int(self._mask[i].sum())  # its left padding ends here
            self._save(self._rows[i], [(layer.keys[i:i + 1, :, start:], layer.values[i:i + 1, :, start:])
                                       for layer in self._cache.layers])
        if not keep:
            self._rows, self._cache, self._mask = [], None, None
            return
        index = torch.tensor(keep, device=self._mask.device)
        self._rows = [self._rows[i] for i in keep]
        mask = self._mask[index]
        start = int((mask.sum(dim=0) > 0).int().argmax())  # the first column some row still uses
        self._mask = mask[:, start:]
        for layer in self._cache.layers:
            layer.keys = layer.keys[index, :, start:]
            layer.values = layer.values[index, :, start:]

    def _forget(self, job: Job) -> None:
        self._procs.pop(id(job), None)
        self._rngs.pop(id(job), None)

    def _end(self, job: Job, error: BaseException | None = None) -> None:
        job.error = error
        if job.streamer is not None:
            job.streamer.end()
        job.done.set()


@atexit.register
def _close_all() -> None:
    """At exit (atexit runs before daemon threads are stopped): let every running loop finish its step."""
    for batcher in list(_LIVE):
        batcher.close()


def _pad_left(t, n: int, dim: int = -2):
    """`t` with n zeros before its entries along `dim` (the sequence axis)."""
    # heavy (torch): the module top stays light
    import torch

    if n <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([torch.zeros(shape, dtype=t.dtype, device=t.device), t], dim=dim)
