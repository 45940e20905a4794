"""The reward stage: score each rollout with a verifier or a user reward function.

``score`` reads ``response_text``, ``answer`` and ``data_source`` of a rollouts table and
appends ``reward`` (float64) and ``reward_error`` (string, null when the call succeeded), so
its output has the ``SCORED`` columns of ``ops/data/schema.py``.

Routing: a row whose ``data_source`` is a key of ``reward_fns`` is scored by that user
callable ``fn(response_text, answer) -> float``; every other row by the built-in verifier
named by ``default`` (see ``VERIFIERS``). A user callable that takes a third parameter (or one
named ``row``) is called ``fn(response_text, answer, row)``, with ``row`` the whole dataset
record as a dict (every column, nested ones as they are: ``metadata``, ``extra_info``,
``reward_model``, a seed ...) plus ``prompt_id``, ``answer``, ``data_source`` and
``sample_idx``. Rewards compare text; none evaluates model text as code.

Failures are per sample and never fatal: a call that raises, returns a non-number, a
non-finite number or one past ``schema.MAX_ABS_REWARD`` (``1e300``, ``10**400``), or runs
past ``timeout_s`` gets ``reward = fallback`` and a one-line ``reward_error``. The time
limit works from any thread (reward tasks run in Dask worker threads, where signal-based
timeouts such as math-verify's own are unavailable): calls run on a daemon worker thread,
reused from row to row, and the stage waits for each result with a timeout
(``GuardedCaller``). A worker that overruns is abandoned and a fresh one takes the next
row; the abandoned one is sent an asynchronous exception (best effort, CPython) so a
pure-Python loop stops soon, but a call blocked in C code (a sleep, a huge integer power) runs
on until it returns. Rows are scored one after the other, so ``k`` hanging calls cost about
``k * timeout_s``.
"""

from __future__ import annotations

import ctypes
import inspect
import math
import numbers
import queue
import re
import threading
from collections.abc import Callable, Mapping
from functools import lru_cache

import pyarrow as pa
import pyarrow.compute as pc
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from ..data.records import record_fields
from ..data.schema import MAX_ABS_REWARD, ROLLOUTS, SCORED, check_columns

RewardFn = Callable[..., float]  # fn(response_text, answer) or fn(response_text, answer, row)

READS = pa.schema([ROLLOUTS.field(name) for name in ("response_text", "answer", "data_source")])
ERROR_CHARS = 200

# Prediction extraction: a \boxed{...} answer wins; otherwise math-verify takes the last
# LaTeX or plain expression ("... = 12", "so the total is 12", "answer 12").
PRED_EXTRACTION = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())


class RewardTimeout(Exception):
    """A reward call ran past its time limit."""


class _Abandoned(SystemExit):
    """Raised asynchronously inside an abandoned reward thread. A ``SystemExit`` so that
    ``threading.excepthook`` drops it silently if it lands outside the call."""


# ---------------------------------------------------------------- built-in verifiers


@lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> tuple:
    """Parse a ground-truth answer with math-verify; ``$...$`` is tried for bare LaTeX."""
    gold = parse(answer, parsing_timeout=None)
    if not gold:
        gold = parse(f"${answer}$", parsing_timeout=None)
    if not gold:
        raise ValueError(f"math verifier cannot parse the ground truth {answer[:80]!r}")
    return tuple(gold)


def math_reward(response_text: str, answer: str | None) -> float:
    """1.0 if the final answer of ``response_text`` equals ``answer`` mathematically.

    The final answer is the last ``\\boxed{...}``, else the last LaTeX or plain expression
    (``= 12``, ``the answer is 12``); equality is math-verify's (``14/2`` equals ``7``).
    Timeouts are off in math-verify (it can only use signals in the main thread); ``score``
    enforces the time limit instead. A missing ground truth raises ``ValueError``."""
    if answer is None:
        raise ValueError("math verifier needs a ground-truth answer, got null")
    gold = list(_parse_gold(answer))
    pred = parse(response_text, extraction_config=PRED_EXTRACTION, parsing_timeout=None)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0


_MARKER = re.compile(r"####|answer\s*(?:is|:)|=", re.IGNORECASE)


def final_answer(text: str) -> str | None:
    """The final answer of ``text`` by a fixed rule, or ``None`` if there is none.

    Rule: the content of the last ``\\boxed{...}`` (braces balanced); otherwise the text after
    the last marker among ``####``, ``answer is``, ``answer:`` and ``=`` (case-insensitive).
    The result is whitespace-collapsed, with surrounding ``$`` and one trailing ``.`` dropped."""
    found = _last_boxed(text)
    if found is None:
        markers = list(_MARKER.finditer(text))
        if not markers:
            return None
        found = text[markers[-1].end() :]
    found = _normalise(found).strip("$ ")
    return found[:-1].rstrip() if found.endswith(".") else found


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` of ``text``, or ``None``."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i]
            depth -= 1
    return None


def _normalise(text: str) -> str:
    return " ".join(text.split())


def exact_reward(response_text: str, answer: str | None) -> float:
    """1.0 if the whitespace-collapsed response equals the whitespace-collapsed answer, or
    the response's ``final_answer`` does; case-sensitive. A null answer raises ``ValueError``."""
    if answer is None:
        raise ValueError("exact verifier needs a ground-truth answer, got null")
    want = _normalise(answer)
    if _normalise(response_text) == want or final_answer(response_text) == want:
        return 1.0
    return 0.0


VERIFIERS: dict[str, RewardFn] = {"math": math_reward, "exact": exact_reward}


# ---------------------------------------------------------------- guarded calls


class GuardedCaller:
    """Runs calls one at a time on a daemon worker thread, each under a time limit.

    The worker is reused from call to call (starting a thread per call costs far more than a
    verifier). A call that overruns raises ``RewardTimeout``; its worker is abandoned and
    interrupted best effort, and the next call starts a fresh one. Works from any thread. Use
    as a context manager, or call ``close`` to let the worker exit."""

    def __init__(self) -> None:
        self._worker: _Worker | None = None

    def call(self, fn: Callable[..., object], args: tuple, timeout_s: float) -> object:
        """Return ``fn(*args)``; re-raise what it raised; ``RewardTimeout`` after ``timeout_s``."""
        if self._worker is None:
            self._worker = _Worker()
        worker = self._worker
        worker.inbox.put((fn, args))
        try:
            ok, value = worker.outbox.get(timeout=timeout_s)
        except queue.Empty:
            self._worker = None
            worker.abandon()
            raise RewardTimeout(f"timeout after {timeout_s:g}s") from None
        if not ok:
            raise value  # type: ignore[misc]
        return value

    def close(self) -> None:
        if self._worker is not None:
            self._worker.inbox.put(None)
            self._worker = None

    def __enter__(self) -> GuardedCaller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Worker:
    """A daemon thread that runs ``(fn, args)`` jobs from ``inbox`` until it reads ``None``,
    putting ``(True, value)`` or ``(False, exception)`` on ``outbox``."""

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="rlhfless-reward", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.inbox.get()) is not None:
            fn, args = job
            try:
                self.outbox.put((True, fn(*args)))
            except BaseException as err:  # every failure of user code is reported as data
                self.outbox.put((False, err))

    def abandon(self) -> None:
        """Stop taking jobs once the current one ends, and try to end it now."""
        self.inbox.put(None)
        _interrupt(self.thread)


def call_with_timeout(fn: Callable[..., object], args: tuple, timeout_s: float) -> object:
    """``GuardedCaller().call(fn, args, timeout_s)`` on a worker used for this call only."""
    with GuardedCaller() as caller:
        return caller.call(fn, args, timeout_s)


def _interrupt(thread: threading.Thread) -> None:
    """Ask ``thread`` to stop by raising ``_Abandoned`` in it at its next bytecode."""
    api = getattr(ctypes, "pythonapi", None)
    if api is None or thread.ident is None or not thread.is_alive():
        return
    hit = api.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_Abandoned))
    if hit > 1:  # never expected; undo rather than hit another thread
        api.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), None)


def takes_row(fn: Callable) -> bool:
    """Whether ``fn`` is called with the row: a third positional parameter, ``*args`` or a
    parameter named ``row``."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: the two-argument form
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return (len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in params)
            or any(p.name == "row" for p in params))


def reward_one(
    caller: GuardedCaller,
    fn: RewardFn,
    response_text: str | None,
    answer: str | None,
    timeout_s: float,
    fallback: float,
    row: dict | None = None,
) -> tuple[float, str | None]:
    """Score one sample: ``(reward, None)``, or ``(fallback, error)`` when the call fails.
    ``row`` is passed as the third argument when given."""
    if response_text is None:
        return fallback, "null response_text"
    args = (response_text, answer) if row is None else (response_text, answer, row)
    try:
        value = caller.call(fn, args, timeout_s)
    except RewardTimeout as err:
        return fallback, str(err)
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # a reward function's failure never stops the stage
        return fallback, describe_error(err)
    return _check_value(value, fallback)


def _check_value(value: object, fallback: float) -> tuple[float, str | None]:
    """Accept a finite real number within ``MAX_ABS_REWARD`` (``bool`` and numpy scalars
    included)."""
    if not isinstance(value, numbers.Real):
        return fallback, _truncate(f"non-numeric reward {_repr(value)} ({type(value).__name__})")
    if isinstance(value, numbers.Integral) and abs(int(value)) > MAX_ABS_REWARD:
        return fallback, (f"reward out of range: an integer of {abs(int(value)).bit_length()} "
                          f"bits; allowed |reward| <= {MAX_ABS_REWARD:g}")
    try:
        number = float(value)
    except (OverflowError, ValueError, TypeError) as err:  # e.g. Fraction(10**400)
        return fallback, _truncate(f"reward out of range: {describe_error(err)}")
    if not math.isfinite(number):
        return fallback, f"non-finite reward {number}"
    if abs(number) > MAX_ABS_REWARD:
        return fallback, f"reward out of range: {number:g}; allowed |reward| <= {MAX_ABS_REWARD:g}"
    return number, None


def _repr(value: object) -> str:
    """``repr(value)``, or what it raised (a huge int past Python's digit limit does)."""
    try:
        return repr(value)
    except Exception as err:  # a user object's __repr__ must not stop the stage
        return f"<unprintable: {describe_error(err)}>"


def describe_error(err: BaseException) -> str:
    """An exception as one bounded line: its type and message."""
    return _truncate(f"{type(err).__name__}: {err}")


def _truncate(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 3] + "..."


# ---------------------------------------------------------------- the stage


def score(
    rollouts: pa.Table,
    reward_fns: Mapping[str, RewardFn] | None = None,
    *,
    default: str = "math",
    timeout_s: float = 5.0,
    fallback: float = 0.0,
) -> pa.Table:
    """Append ``reward`` (float64) and ``reward_error`` (string) to ``rollouts``.

    Reads ``response_text``, ``answer`` and ``data_source`` (``READS``: the ``ROLLOUTS``
    types, so small tables with just these columns are accepted), and for a function that
    takes the row, ``record``, ``prompt_id`` and ``sample_idx`` where present; all columns
    are kept in order. ``reward_fns`` maps a ``data_source`` to a callable
    ``fn(response_text, answer)`` or ``fn(response_text, answer, row)``; other rows use
    ``VERIFIERS[default]``. Each call is limited to ``timeout_s`` seconds; a
    failing call scores ``fallback`` and records why in ``reward_error``."""
    _check_arguments(rollouts, reward_fns, default, timeout_s, fallback)
    routes = dict(reward_fns or {})
    builtin = VERIFIERS[default]
    rewards: list[float] = []
    errors: list[str | None] = []
    wants_row = {source for source, fn in routes.items() if takes_row(fn)}
    rows = zip(
        rollouts.column("response_text").to_pylist(),
        rollouts.column("answer").to_pylist(),
        rollouts.column("data_source").to_pylist(),
        range(len(rollouts)),
        strict=True,
    )
    with GuardedCaller() as caller:
        for response_text, answer, source, i in rows:
            fn = routes.get(source, builtin) if source is not None else builtin
            row = _row(rollouts, i) if source in wants_row else None
            reward, error = reward_one(caller, fn, response_text, answer, timeout_s, fallback,
                                       row)
            rewards.append(reward)
            errors.append(error)
    table = rollouts.append_column(SCORED.field("reward"), pa.array(rewards, pa.float64()))
    return table.append_column(SCORED.field("reward_error"), pa.array(errors, pa.string()))


ROW_COLUMNS = ("record", "prompt_id", "answer", "data_source", "sample_idx")


def _row(rollouts: pa.Table, i: int) -> dict:
    """Row ``i``'s dataset record with its ``ROW_COLUMNS`` (those the table has)."""
    names = [n for n in ROW_COLUMNS if n in rollouts.column_names]
    return record_fields(rollouts.select(names).slice(i, 1).to_pylist()[0])


def _check_arguments(
    rollouts: pa.Table,
    reward_fns: Mapping[str, RewardFn] | None,
    default: str,
    timeout_s: float,
    fallback: float,
) -> None:
    check_columns(rollouts, READS, "score")
    for name in ("reward", "reward_error"):
        if name in rollouts.column_names:
            raise ValueError(f"score: the table already has a {name!r} column; score it once")
    if default not in VERIFIERS:
        raise ValueError(f"score: unknown default verifier {default!r}; allowed: {list(VERIFIERS)}")
    for source, fn in (reward_fns or {}).items():
        if not callable(fn):
            raise ValueError(
                f"score: reward_fns[{source!r}] is {type(fn).__name__}, expected a callable "
                "fn(response_text, answer[, row]) -> float"
            )
    if not (isinstance(timeout_s, numbers.Real) and timeout_s > 0):
        raise ValueError(
            f"score: timeout_s must be a positive number of seconds, got {timeout_s!r}"
        )
    if not (isinstance(fallback, numbers.Real) and math.isfinite(fallback)
            and abs(fallback) <= MAX_ABS_REWARD):
        raise ValueError(f"score: fallback must be a finite number within "
                         f"{MAX_ABS_REWARD:g}, got {fallback!r}")


def reward_summary(scored: pa.Table) -> dict:
    """``{"reward_mean": mean reward (0.0 for no rows), "reward_errors": rows with an error}``."""
    reads = pa.schema([SCORED.field("reward"), SCORED.field("reward_error")])
    check_columns(scored, reads, "reward_summary")
    mean = pc.mean(scored.column("reward")).as_py()
    errors = scored.num_rows - scored.column("reward_error").null_count
    return {"reward_mean": float(mean or 0.0), "reward_errors": int(errors)}


ERROR_KINDS = {  # reward_error prefix -> metric counting it (any other error: "raised")
    "timeout after": "reward_timeouts",
    "non-finite reward": "reward_nonfinite",
    "reward out of range": "reward_out_of_range",
    "non-numeric reward": "reward_nonnumeric",
}


def reward_error_counts(scored: pa.Table) -> dict[str, int]:
    """Failed reward calls by kind: ``reward_timeouts`` (past the time limit),
    ``reward_nonfinite`` (NaN or inf), ``reward_out_of_range`` (past ``MAX_ABS_REWARD``),
    ``reward_nonnumeric`` and ``reward_raised`` (the call raised, or there was no response
    text); they sum to ``reward_errors``."""
    check_columns(scored, pa.schema([SCORED.field("reward_error")]), "reward_error_counts")
    counts = dict.fromkeys([*ERROR_KINDS.values(), "reward_raised"], 0)
    for error in scored.column("reward_error").drop_null().to_pylist():
        kind = next((m for p, m in ERROR_KINDS.items() if error.startswith(p)), "reward_raised")
        counts[kind] += 1
    return counts
