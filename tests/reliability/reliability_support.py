"""Shared pieces of the reliability suite: a tiny random model built from a config
(no download), a word-level tokenizer, point builders, probes that misbehave on
purpose, and the accounting checks every test applies to every result."""

from __future__ import annotations

import _thread
import os
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from functools import cache
from typing import Any

from undercurrent.probes import Probe
from undercurrent.records import ProbeResult, ProbeSignal, SignalAction
from undercurrent.spec.types import ExtractionPoint, ProbeKind

VOCAB_WORDS = [f"t{i}" for i in range(60)]
NUM_LAYERS = 2
HIDDEN = 32
MAX_POSITIONS = 64
"""The tiny model's context length: prompts longer than this are "too long"."""

BOTH_KINDS = (ProbeKind.SINGLE_SHOT, ProbeKind.TRAJECTORY)


def prompt(*indices: int) -> str:
    """A prompt of the tokenizer's words ``t<i>``."""
    return " ".join(VOCAB_WORDS[i % len(VOCAB_WORDS)] for i in indices)


@cache
def tiny_tokenizer() -> Any:
    """Word-level tokenizer: <pad>=0, <bos>=1, <eos>=2, <unk>=3, then t0..t59;
    encoding prepends <bos> (so even "" is one token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(["<pad>", "<bos>", "<eos>", "<unk>", *VOCAB_WORDS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")
    core.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                        special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")


@cache
def tiny_model() -> Any:
    """A seeded random 2-layer Llama (hidden 32, context 64) with no eos, so every
    generation runs to ``max_new_tokens``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(VOCAB_WORDS) + 4, hidden_size=HIDDEN,
                         intermediate_size=64, num_hidden_layers=NUM_LAYERS,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=MAX_POSITIONS, pad_token_id=0,
                         bos_token_id=1, eos_token_id=None)
    torch.manual_seed(7)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def point(name: str, *, layers: Iterable[int] = (0,), tensor_type: str = "residual_stream",
          position: Any = "generated[*]", probe_type: str = "norm_probe",
          probe_kind: str | None = None, execution_mode: str = "inline",
          intervention: Mapping[str, Any] | None = None, queue_depth: int | None = None,
          probe_args: Mapping[str, Any] | None = None) -> ExtractionPoint:
    """An extraction point with test-friendly defaults (trajectory for continuous
    positions, single_shot otherwise)."""
    from undercurrent.spec.position import parse_position
    from undercurrent.spec.types import InterventionPolicy

    if probe_kind is None:
        probe_kind = "trajectory" if parse_position(position).is_continuous else "single_shot"
    extra: dict[str, Any] = {}
    if intervention is not None:
        extra["intervention"] = InterventionPolicy(**intervention)
    if queue_depth is not None:
        extra["queue_depth"] = queue_depth
    return ExtractionPoint(name=name, layers=tuple(layers), tensor_type=tensor_type,
                           position=position, probe_type=probe_type, probe_kind=probe_kind,
                           execution_mode=execution_mode, probe_args=dict(probe_args or {}),
                           **extra)


def check_accounting(result: ProbeResult) -> None:
    """Every record a binding received was processed or dropped, exactly once."""
    stats = result.stats
    assert stats.received == stats.processed + stats.dropped, (
        f"{result.extraction_point_name}: received {stats.received} != processed "
        f"{stats.processed} + dropped {stats.dropped}")
    assert stats.errors <= stats.processed + 2  # on_start and on_end may add one each


def record_idle_waits(monkeypatch: Any) -> list[bool]:
    """Whether each inline binding was found idle when its request ended (False:
    ending the request gave up waiting for a binding still marked busy), appended
    as requests end. (Inline bindings only: an interrupt ends an async binding
    without waiting, its queued records counted as dropped.)"""
    from undercurrent.router.binding import Binding

    seen: list[bool] = []
    wait_idle = Binding.wait_idle

    def recording(self: Any, deadline: float) -> bool:
        idle = wait_idle(self, deadline)
        if not self._is_async:
            seen.append(idle)
        return idle

    monkeypatch.setattr(Binding, "wait_idle", recording)
    return seen


def live_hooks(model: Any) -> int:
    """Forward hooks (plain and with kwargs) and pre-hooks still on any module."""
    return sum(len(module._forward_hooks) + len(module._forward_pre_hooks)
               for module in model.modules())


# -- probes that misbehave on purpose -------------------------------------------------------


class Recorder(Probe):
    """A well-behaved probe: scores each activation with its token index and returns
    every index it saw as its verdict."""

    probe_kind = BOTH_KINDS

    def on_start(self, ctx: Any) -> None:
        self.seen: list[int] = []

    def on_activation(self, record: Any) -> ProbeSignal:
        self.seen.append(record.token_index)
        return ProbeSignal(score=float(record.token_index))

    def on_end(self, ctx: Any) -> dict[str, Any]:
        return {"seen": list(self.seen)}


class RaisesInInit(Recorder):
    def __init__(self, **kwargs: Any) -> None:
        raise RuntimeError("broken constructor")


class RaisesOnStart(Recorder):
    def on_start(self, ctx: Any) -> None:
        raise RuntimeError("broken on_start")


class RaisesOnActivation(Recorder):
    """Raises on every activation from generated index ``from_index`` on."""

    def __init__(self, from_index: int = 0) -> None:
        self.from_index = from_index

    def on_activation(self, record: Any) -> ProbeSignal:
        if record.generated_index is not None and record.generated_index >= self.from_index:
            raise ValueError(f"broken on_activation at token {record.token_index}")
        return super().on_activation(record)


class RaisesOnEnd(Recorder):
    def on_end(self, ctx: Any) -> Any:
        raise RuntimeError("broken on_end")


class ReturnsGarbage(Recorder):
    """Returns something that is not a ProbeSignal (a dict, a string, a tensor...)."""

    def __init__(self, value: Any = "not a signal") -> None:
        self.value = value

    def on_activation(self, record: Any) -> Any:
        super().on_activation(record)
        return self.value


class Sleeps(Recorder):
    """Sleeps ``seconds`` in every on_activation (a slow or hanging probe)."""

    def __init__(self, seconds: float = 0.05) -> None:
        self.seconds = seconds

    def on_activation(self, record: Any) -> ProbeSignal:
        time.sleep(self.seconds)
        return super().on_activation(record)


class Hangs(Recorder):
    """Blocks in on_activation until ``release`` is set (or ``limit_s`` passes)."""

    release = threading.Event()
    limit_s = 30.0

    def on_activation(self, record: Any) -> ProbeSignal:
        type(self).release.wait(self.limit_s)
        return super().on_activation(record)


class Interrupts(Recorder):
    """Raises ``KeyboardInterrupt`` (or ``SystemExit``) at generated index ``at``, as
    Ctrl-C would while the probe runs on the generation thread; only while ``armed``
    is set, and only once (it clears ``armed``)."""

    armed = threading.Event()

    def __init__(self, at: int = 2, error: str = "keyboard") -> None:
        self.at = at
        self.error = error

    def on_activation(self, record: Any) -> ProbeSignal:
        if record.generated_index == self.at and type(self).armed.is_set():
            type(self).armed.clear()
            if self.error == "keyboard":
                raise KeyboardInterrupt
            raise SystemExit("probe called sys.exit")
        return super().on_activation(record)


class AbortsAt(Recorder):
    """Aborts at generated index ``at``."""

    def __init__(self, at: int = 2) -> None:
        self.at = at

    def on_activation(self, record: Any) -> ProbeSignal:
        super().on_activation(record)
        if record.generated_index == self.at:
            return ProbeSignal(action=SignalAction.ABORT, score=1.0)
        return ProbeSignal(score=0.0)


class CtrlCSoon(Recorder):
    """A Ctrl-C at a random moment that always lands inside the generation.

    At generated index ``plan[0]`` (while ``armed``) it starts a thread that, ``plan[1]``
    seconds later, simulates a Ctrl-C (``_thread.interrupt_main``): it lands wherever the
    main thread happens to be (a forward pass, a hook, the router, sampling, a stream's
    consumer). From generated index ``plan[2]`` on, the probe (inline, so generation
    waits for it) holds generation until that Ctrl-C has been sent: however slow or busy
    the machine, the interrupt reaches the main thread before the generation can end.
    """

    armed = threading.Event()
    sent = threading.Event()
    plan = (0, 0.0, 2)
    timers: list[threading.Timer] = []
    fence_limit_s = 120.0
    deliver: Any = staticmethod(_thread.interrupt_main)
    """How the Ctrl-C is delivered (a test may send a real SIGINT to several processes,
    as a terminal does to its foreground process group)."""

    def on_activation(self, record: Any) -> ProbeSignal:
        cls = type(self)
        at, delay, fence = cls.plan
        index = record.generated_index
        if index == at and cls.armed.is_set():
            cls.armed.clear()
            timer = threading.Timer(delay, _ctrl_c)
            cls.timers.append(timer)
            timer.start()
        elif index is not None and index >= fence and cls.timers:
            cls.sent.wait(cls.fence_limit_s)
        return super().on_activation(record)


def _ctrl_c() -> None:
    CtrlCSoon.deliver()
    CtrlCSoon.sent.set()


def interrupted_by_ctrl_c(action: Any, at: int, delay: float, fence: int) -> bool:
    """Run ``action()`` with a :class:`CtrlCSoon` armed (fence at generated index
    ``fence``); True when the Ctrl-C landed inside it. A Ctrl-C that comes after
    ``action`` returned is absorbed here, so it can never hit the caller's next
    statement."""
    if not at < fence:
        raise ValueError(f"the fence ({fence}) must come after the Ctrl-C is armed ({at})")
    CtrlCSoon.plan = (at, delay, fence)
    CtrlCSoon.sent.clear()
    CtrlCSoon.armed.set()
    finished = False
    try:
        try:
            action()
            finished = True
        finally:
            CtrlCSoon.armed.clear()
            while CtrlCSoon.timers:
                # interrupt_main has run once join returns; the loop's next backward
                # jump in this (main) thread raises the pending KeyboardInterrupt here.
                CtrlCSoon.timers.pop().join()
    except KeyboardInterrupt:
        pass
    return not finished


TEST_PROBES = {
    "recorder": Recorder,
    "raises_in_init": RaisesInInit,
    "raises_on_start": RaisesOnStart,
    "raises_on_activation": RaisesOnActivation,
    "raises_on_end": RaisesOnEnd,
    "returns_garbage": ReturnsGarbage,
    "sleeps": Sleeps,
    "hangs": Hangs,
    "interrupts": Interrupts,
    "aborts_at": AbortsAt,
    "ctrl_c_soon": CtrlCSoon,
}


def soak_seconds(default: float) -> float:
    """``UNDERCURRENT_SOAK_SECONDS`` when set (the long mode), else ``default``."""
    raw = os.environ.get("UNDERCURRENT_SOAK_SECONDS")
    return float(raw) if raw else default


# -- soak bookkeeping -----------------------------------------------------------------------


class SoakLedger:
    """What every generation thread of a soak saw, merged under a lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = 0
        self.records: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.failures: list[str] = []


def expected_seen(output: Any, name: str) -> list[int]:
    """The token indices a ``recorder`` point of the soak specs must have seen."""
    prompt_len = len(output.prompt_token_ids)
    fed = len(output.token_ids) - 1  # the last sampled token is never fed back
    if name == "inline_prompt":
        return [prompt_len - 1] * 2  # layers 0 and 1
    if name == "async_kv":
        return [prompt_len + g for g in range(min(fed, 8))]
    return [prompt_len + g for g in range(fed)]


def check_soak_output(output: Any, ledger: SoakLedger, drop_policy: str,
                      may_drop: set[str]) -> None:
    """Exact accounting on every result; drops only where the policy allows them;
    every binding that may not drop saw exactly its tokens (records lost = 0)."""
    for name, result in output.results.items():
        stats = result.stats
        problems = []
        if stats.received != stats.processed + stats.dropped:
            problems.append(f"received {stats.received} != processed {stats.processed} + "
                            f"dropped {stats.dropped}")
        if stats.errors or stats.timeouts or result.error:
            problems.append(f"errors {stats.errors}, timeouts {stats.timeouts}: {result.error}")
        allowed = name in may_drop and drop_policy != "block"
        if stats.dropped and not allowed:
            problems.append(f"dropped {stats.dropped} under {drop_policy}")
        if not allowed and result.verdict["seen"] != expected_seen(output, name):
            problems.append(f"saw {result.verdict['seen']}, expected "
                            f"{expected_seen(output, name)}")
        with ledger.lock:
            ledger.records[name] += stats.received
            ledger.dropped[name] += stats.dropped
            ledger.failures += [f"{output.request_id}/{name}: {p}" for p in problems]
