"""Calibration of dpverify's default tolerance on scenarios dpverify does not generate itself.

An independent random scenario generator, written here and deliberately wider than
``dpverify.strategies``: input scales 1e-8 .. 1e8, parameter gains 1e-3 .. 1e3, loss scaling,
near-converged targets (the model's own output plus tiny residuals), unused, frozen and tied
parameters, LayerNorm over one or two features, residual blocks, LSTM/GRU,
MultiheadAttention (float64 too), float32/float64/bfloat16/float16, batches of 1 to 33 rows
on 1 to 8 virtual devices with non-contiguous ids and any ``output_device`` (or -1), five
mean losses, and models whose forward returns their loss. A second stream of draws
(``widen``, outside the sensitivity subsample) adds the classes an independent generator
found false alarms and a crash in: RMSNorm stacks, tied language models (``padding_idx``,
token cross-entropy with -100, masked sequence-first attention), float64 attention over one
token with inputs of 1e4..1e5, subnormal float64 inputs, near-converged smooth L1 with a
frozen output bias, keyword-only forwards, and nested dict/tuple/namedtuple outputs. Every
model is one that
DataParallel must reproduce exactly (BatchNorm and Dropout only in eval mode), so every
check must pass.

For each scenario, through dpverify's public API only:

- ``assert_dp_grads_match`` and ``assert_grad_sum_equals_mean_loss_grad`` (default tolerance,
  default ``parallel``): a ``ParallelMismatch`` is a false alarm, any other exception a crash;
  ``worst_ratio`` (error / allowed) is collected;
- for loss-head models with even chunks, ``check_forward_loss_average``: ``is_biased`` is a
  false alarm (equal chunks make the mean of per-replica means exact);
- on every 10th scenario (float32, input scale one of 1e-6, 1e-3, 1, 1e3, 1e6), sensitivity:
  a relative error is injected into one parameter's reduced gradient in the parallel step
  (a ``VirtualDataParallel`` subclass with a gradient hook): the whole tensor and ~1% of its
  elements times (1 + eps) for eps in 1e-4, 1e-5, 1e-6, and its largest element times
  (1 + 1e-4); next to whether ``assert_dp_grads_match`` catches it, the single-device float32
  step's own distance from float64 on that tensor, max|g32 - g64| / max|g64|.

Every scenario prints as a one-line spec; ``build(spec)`` reconstructs it exactly.

Usage:
    python benchmarks/calibrate.py [--n 10000] [--seed 0] [--show 20]
    python benchmarks/calibrate.py --only INDEX [--seed 0]     # one scenario, full messages
    python benchmarks/calibrate.py --spec 'i=3 kind=mlp ...'    # a pasted spec
"""

from __future__ import annotations

import copy
import itertools
import math
import random
import sys
import time
import traceback
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from calibration import ClassTally, drive
from torch import nn

import dpverify

KINDS = ("mlp", "residual", "layernorm", "lstm", "gru", "attention", "conv")
#: Drawn in a second stream (``widen``) so that the scenarios above keep their draws.
WIDE_KINDS = ("rmsnorm", "lm")
LOSSES = ("mse", "l1", "smooth_l1", "ce", "bce")
DTYPES: dict[str, torch.dtype] = {
    "f32": torch.float32,
    "f64": torch.float64,
    "bf16": torch.bfloat16,
    "f16": torch.float16,
}
ACTS = ("relu", "tanh", "gelu", "silu", "sigmoid", "softplus", "none")
MODS = ("unused", "frozen", "tied", "eval")
#: Input scales of the sensitivity subsample.
SCALE_BUCKETS = (1e-6, 1e-3, 1.0, 1e3, 1e6)
EPSILONS = (1e-4, 1e-5, 1e-6)
#: The target: errors of 1e-5 caught wherever the single-device step is this close to float64.
WELL_CONDITIONED = 1e-6
SENSITIVITY_EVERY = 10
#: log10 ranges (input scale, gain, loss scale) per dtype: low precision stays clear of overflow.
RANGES: dict[str, tuple[tuple[float, float], tuple[float, float], tuple[float, float]]] = {
    "f32": ((-8, 8), (-3, 3), (-4, 4)),
    "f64": ((-8, 8), (-3, 3), (-4, 4)),
    "bf16": ((-3, 3), (-1, 1), (-2, 2)),
    "f16": ((-2, 1), (-0.5, 0.5), (-2, 1)),
}


# --------------------------------------------------------------------------------------
# The scenario spec: a line you can paste, and the generator that draws it.


@dataclass(frozen=True)
class Spec:
    """One scenario. ``str(spec)`` is a line that ``Spec.parse`` reads back exactly."""

    i: int  # index in the run (informative)
    kind: str  # model family, KINDS
    dt: str  # dtype, DTYPES
    B: int  # batch rows
    dev: tuple[int, ...]  # device_ids
    out: int  # output_device (-1: the host)
    loss: str  # LOSSES
    ls: float  # loss scale
    xs: float  # input scale
    g: float  # gain applied to every initialised parameter
    w: int  # input features
    h: int  # hidden width
    o: int  # outputs
    d: int  # depth (layers / blocks)
    T: int  # sequence length (rnn, attention, conv)
    opt: int  # kind-specific option bits (see the model classes)
    act: str  # ACTS
    mods: tuple[str, ...]  # MODS
    near: float  # 0: random targets; else near-converged, residual relative size
    head: int  # 1: forward returns its loss (model(x, y) -> (out, per-row loss))
    sens: int  # 1: part of the sensitivity subsample
    seed: int  # torch seed for weights and data, and secondary choices
    io: int = 0  # forward interface bits: 1 keyword-only forward, 2 nested dict/tuple/namedtuple output

    def __str__(self) -> str:
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                text = ",".join(map(str, value)) or "-"
            elif isinstance(value, float):
                text = repr(value)
            else:
                text = str(value)
            parts.append(f"{f.name}={text}")
        return " ".join(parts)

    @classmethod
    def parse(cls, text: str) -> Spec:
        values: dict[str, Any] = {}
        types = {f.name: f.type for f in fields(cls)}
        for part in text.split():
            key, _, raw = part.partition("=")
            if key not in types:
                raise ValueError(f"unknown spec field {key!r} in {text!r}")
            kind = str(types[key])
            if kind == "int":
                values[key] = int(raw)
            elif kind == "float":
                values[key] = float(raw)
            elif kind == "tuple[int, ...]":
                values[key] = tuple(int(v) for v in raw.split(","))
            elif kind == "tuple[str, ...]":
                values[key] = () if raw == "-" else tuple(raw.split(","))
            else:
                values[key] = raw
        missing = {f.name for f in fields(cls) if f.default is MISSING} - set(values)
        if missing:
            raise ValueError(f"spec lacks {sorted(missing)}: {text!r}")
        return cls(**values)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dt]

    @property
    def chunks(self) -> list[int]:
        """torch.chunk's split of B rows over len(dev) devices (computed here, independently)."""
        size = -(-self.B // len(self.dev))
        return [min(size, self.B - start) for start in range(0, self.B, size)]

    @property
    def even(self) -> bool:
        return len(set(self.chunks)) == 1

    @property
    def classes(self) -> list[str]:
        tags = [f"kind:{self.kind}", f"dtype:{self.dt}", f"loss:{self.loss}"]
        if self.kind == "attention" and self.dt == "f64":
            tags.append("attention:f64")
            if self.T == 1 and self.xs > 1e3:
                tags.append("attention:f64-one-token-large")
        if self.kind == "lm":
            tags.append("lm:tied-padding-idx-ce-100" + (":masked-seq-first" if self.opt & 1 else ""))
        if self.io & 1:
            tags.append("io:keyword-only")
        if self.io & 2:
            tags.append("io:nested-output")
        if self.xs < 1e-290:
            tags.append("x:subnormal")
        tags += [f"mod:{m}" for m in self.mods]
        if self.near:
            tags.append("near-converged")
        if self.head:
            tags.append("loss-head")
        x = math.log10(self.xs)
        tags.append("x:<1e-4" if x < -4 else "x:>1e4" if x > 4 else "x:1e-4..1e4")
        if "frozen-bias" in self.mods and self.near:
            tags.append("near-converged:frozen-bias")
        gain = math.log10(self.g)
        if abs(gain) > 1:
            tags.append("gain:<0.1" if gain < 0 else "gain:>10")
        if abs(math.log10(self.ls)) > 2:
            tags.append("loss-scale:extreme")
        tags.append("devices:1" if len(self.dev) == 1 else "devices:2-8")
        if len(self.dev) > self.B:
            tags.append("batch<devices")
        if self.out == -1:
            tags.append("output:host")
        elif self.out != self.dev[0]:
            tags.append("output:other")
        return tags


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return float(f"{10 ** rng.uniform(lo, hi):.4g}")


def generate(index: int, seed: int) -> Spec:
    """The scenario at ``index`` of the run with ``seed``: deterministic, independent of order."""
    rng = random.Random(f"calibrate:{seed}:{index}")
    sens = index % SENSITIVITY_EVERY == 0
    dt = "f32" if sens else rng.choices(list(DTYPES), weights=(50, 20, 15, 15))[0]
    kind = rng.choice(KINDS)
    loss = rng.choice(LOSSES)
    head = int(rng.random() < 0.15)
    n = rng.randint(1, 8)
    dev = sorted(rng.sample(range(12), n))
    if rng.random() < 0.3:
        rng.shuffle(dev)
    out = rng.choice([*dev, -1])
    if head and rng.random() < 0.7:
        # equal chunks, so that the loss-average check applies: B = c * k with ceil(B/n) = c
        options = [(c, k) for c in range(1, 34) for k in range(1, n + 1) if c * k <= 33 and -(-c * k // n) == c]
        c, k = rng.choice(options)
        batch = c * k
    else:
        batch = rng.choice([rng.randint(1, 33), rng.randint(1, max(1, n - 1)), n * rng.randint(1, max(1, 33 // n))])
    (x_lo, x_hi), (g_lo, g_hi), (l_lo, l_hi) = RANGES[dt]
    xs = SCALE_BUCKETS[(index // SENSITIVITY_EVERY) % len(SCALE_BUCKETS)] if sens else _log_uniform(rng, x_lo, x_hi)
    w, h, o = rng.randint(1, 6), rng.randint(1, 8), rng.randint(1, 4)
    d, seq, opt = rng.randint(1, 3), rng.randint(1, 4), rng.randint(0, 3)
    if kind == "layernorm":
        h = rng.randint(1, 2)
        if opt & 1:
            w = h
    if kind == "attention":
        w = (1 + (opt & 1)) * rng.randint(1, 4)  # embed dim, divisible by the heads
    if kind == "conv":
        seq = max(seq, 1 + opt % 3)
    if loss == "ce":
        o = max(o, 2)
    mods = tuple(m for m in MODS if rng.random() < 0.15)
    near = _log_uniform(rng, -8, -4) if rng.random() < 0.2 else 0.0
    spec = Spec(
        i=index, kind=kind, dt=dt, B=batch, dev=tuple(dev), out=out, loss=loss,
        ls=_log_uniform(rng, l_lo, l_hi), xs=xs, g=_log_uniform(rng, g_lo, g_hi),
        w=w, h=h, o=o, d=d, T=seq, opt=opt, act=rng.choice(ACTS), mods=mods, near=near,
        head=head, sens=int(sens), seed=rng.randrange(2**31),
    )
    return spec if sens else widen(spec, random.Random(f"calibrate-wide:{seed}:{index}"))


def widen(s: Spec, rng: random.Random) -> Spec:
    """The classes an independent generator found false alarms and a crash in, drawn in
    their own stream (the sensitivity subsample is left as it was): RMSNorm stacks, tied
    language models (``padding_idx``, token cross-entropy with -100, masked seq-first
    attention), float64 attention over one token with inputs of 1e4..1e5, subnormal float64
    inputs, near-converged smooth L1 with a frozen output bias, keyword-only forwards and
    nested dict/tuple/namedtuple outputs."""
    draw = rng.random()
    if draw < 0.08:
        s = replace(s, kind="rmsnorm")
    elif draw < 0.14 and s.dt != "f16":
        # token ids, not scaled inputs; per-token CE over a vocabulary of o + 2
        s = replace(s, kind="lm", loss="token_ce", head=0, T=max(s.T, 2), xs=1.0, o=max(s.o, 2))
    if s.kind == "attention" and s.dt == "f64" and rng.random() < 0.3:
        s = replace(s, T=1, xs=_log_uniform(rng, 4, 5))
    if s.dt == "f64" and s.kind != "lm" and rng.random() < 0.04:
        s = replace(s, xs=_log_uniform(rng, -318, -300))
    if s.near and s.kind != "lm" and rng.random() < 0.3:
        loss = "smooth_l1" if rng.random() < 0.7 else s.loss
        s = replace(s, loss=loss, mods=(*(m for m in s.mods if m != "frozen"), "frozen-bias"))
    io = (rng.random() < 0.1) | (2 * (rng.random() < 0.1 and not s.head))
    return replace(s, io=io)


# --------------------------------------------------------------------------------------
# Models. All map a batch to [rows, outputs]; none depends on the batch split.


def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "relu":
        return F.relu(x)
    if name == "tanh":
        return torch.tanh(x)
    if name == "gelu":
        return F.gelu(x)
    if name == "silu":
        return F.silu(x)
    if name == "sigmoid":
        return torch.sigmoid(x)
    if name == "softplus":
        return F.softplus(x)
    return x


class MLP(nn.Module):
    """Linear layers with ``act`` between them; opt bit 0: no biases."""

    def __init__(self, s: Spec) -> None:
        super().__init__()
        dims = [s.w] + [s.h] * (s.d - 1) + [s.o]
        self.act = s.act
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=not s.opt & 1) for a, b in itertools.pairwise(dims))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            x = layer(x)
            if index < len(self.layers) - 1:
                x = _act(self.act, x)
        return x


class Residual(nn.Module):
    """x + f(x) blocks; opt bit 0: pre-LayerNorm in each block."""

    def __init__(self, s: Spec) -> None:
        super().__init__()
        self.act = s.act
        self.inp = nn.Linear(s.w, s.h)
        self.norms = nn.ModuleList(nn.LayerNorm(s.h) if s.opt & 1 else nn.Identity() for _ in range(s.d))
        self.first = nn.ModuleList(nn.Linear(s.h, s.h) for _ in range(s.d))
        self.second = nn.ModuleList(nn.Linear(s.h, s.h) for _ in range(s.d))
        self.outp = nn.Linear(s.h, s.o)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for norm, first, second in zip(self.norms, self.first, self.second, strict=True):
            x = x + second(_act(self.act, first(norm(x))))
        out: torch.Tensor = self.outp(x)
        return out


class LayerNormNet(nn.Module):
    """LayerNorm over h in {1, 2} features; opt bit 0: straight on the input (w = h)."""

    def __init__(self, s: Spec) -> None:
        super().__init__()
        self.act = s.act
        self.on_input = bool(s.opt & 1)
        self.inp = None if self.on_input else nn.Linear(s.w, s.h)
        self.norm = nn.LayerNorm(s.h)
        self.outp = nn.Linear(s.h, s.o)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inp is not None:
            x = self.inp(x)
        out: torch.Tensor = self.outp(_act(self.act, self.norm(x)))
        return out


class RNNNet(nn.Module):
    """LSTM or GRU (batch_first); opt bit 0: two layers; bit 1: mean over time, else last step."""

    def __init__(self, s: Spec) -> None:
        super().__init__()
        cls = nn.LSTM if s.kind == "lstm" else nn.GRU
        self.rnn = cls(s.w, s.h, num_layers=1 + (s.opt & 1), batch_first=True)
        self.mean = bool(s.opt & 2)
        self.outp = nn.Linear(s.h, s.o)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.rnn(x)[0]
        out: torch.Tensor = self.outp(y.mean(1) if self.mean else y[:, -1])
        return out


class AttentionNet(nn.Module):
    """Self-attention, batch_first, w = embed dim; opt bit 0: two heads; bit 1: add_bias_kv."""

    def __init__(self, s: Spec) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(s.w, 1 + (s.opt & 1), bias=True, add_bias_kv=bool(s.opt & 2), batch_first=True)
        self.outp = nn.Linear(s.w, s.o)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.attn(x, x, x, need_weights=False)[0]
        out: torch.Tensor = self.outp(y.mean(1))
        return out


class ConvNet(nn.Module):
    """Conv1d with kernel 1 + opt % 3 over [rows, w, T], then a Linear head."""

    def __init__(self, s: Spec) -> None:
        super().__init__()
        kernel = 1 + s.opt % 3
        self.act = s.act
        self.conv = nn.Conv1d(s.w, s.h, kernel)
        self.outp = nn.Linear(s.h * (s.T - kernel + 1), s.o)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.outp(_act(self.act, self.conv(x)).flatten(1))
        return out


class RMSNormNet(nn.Module):
    """Linear, then ``d`` blocks of RMSNorm, Linear and ``act``, then a Linear head with a
    bias; opt bit 0: RMSNorm without a weight."""

    def __init__(self, s: Spec) -> None:
        super().__init__()
        self.act = s.act
        self.inp = nn.Linear(s.w, s.h)
        self.norms = nn.ModuleList(nn.RMSNorm(s.h, elementwise_affine=not s.opt & 1) for _ in range(s.d))
        self.layers = nn.ModuleList(nn.Linear(s.h, s.h) for _ in range(s.d))
        self.outp = nn.Linear(s.h, s.o)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for norm, layer in zip(self.norms, self.layers, strict=True):
            x = _act(self.act, layer(norm(x)))
        out: torch.Tensor = self.outp(x)
        return out


class LMNet(nn.Module):
    """A language model over ``o + 2`` tokens (token 0 pads): an embedding with
    ``padding_idx=0``, an optional masked self-attention in the sequence-first layout (opt bit
    0: ``batch_first=False`` with a key padding mask), ``act``, and logits through the
    embedding's own weight (tied) plus a bias: [rows, T, vocabulary]."""

    def __init__(self, s: Spec) -> None:
        super().__init__()
        vocab, width = s.o + 2, 2 * s.h
        self.act = s.act
        self.embed = nn.Embedding(vocab, width, padding_idx=0)
        self.attn = nn.MultiheadAttention(width, 2, batch_first=False) if s.opt & 1 else None
        self.mix = nn.Linear(width, width)
        self.bias = nn.Parameter(torch.zeros(vocab))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.attn is not None:
            seq = x.transpose(0, 1)  # [T, rows, width]
            x = x + self.attn(seq, seq, seq, key_padding_mask=tokens == 0, need_weights=False)[0].transpose(0, 1)
        x = _act(self.act, self.mix(x))
        return F.linear(x, self.embed.weight, self.bias)


BODIES: dict[str, Callable[[Spec], nn.Module]] = {
    "mlp": MLP, "residual": Residual, "layernorm": LayerNormNet, "lstm": RNNNet, "gru": RNNNet,
    "attention": AttentionNet, "conv": ConvNet, "rmsnorm": RMSNormNet, "lm": LMNet,
}


class Net(nn.Module):
    """The body, plus the modifiers: BatchNorm and Dropout (the model is put in eval mode),
    a tied pair (one Parameter in two Linear layers), an unused submodule."""

    def __init__(self, s: Spec) -> None:
        super().__init__()
        self.body = BODIES[s.kind](s)
        self.act = s.act
        eval_mods = "eval" in s.mods and s.kind != "lm"  # BatchNorm1d over [rows, outputs] only
        self.bn = nn.BatchNorm1d(s.o) if eval_mods else None
        self.drop = nn.Dropout(0.5) if eval_mods else None
        tied = "tied" in s.mods and s.kind != "lm"  # the language model ties its own weights
        self.tie_a = nn.Linear(s.o, s.o) if tied else None
        self.tie_b = nn.Linear(s.o, s.o) if tied else None
        if self.tie_a is not None and self.tie_b is not None:
            self.tie_b.weight = self.tie_a.weight
        self.unused = nn.Linear(3, 2) if "unused" in s.mods else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.body(x)
        if self.bn is not None and self.drop is not None:
            y = self.drop(self.bn(y))
        if self.tie_a is not None and self.tie_b is not None:
            y = self.tie_b(_act(self.act, self.tie_a(y)))
        return y


class KeywordOnly(nn.Module):
    """``forward(*, x, y=None)``: the batch reaches the model by keyword only."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, *, x: torch.Tensor, y: torch.Tensor | None = None) -> Any:
        return self.net(x) if y is None else self.net(x, y)


class Pair(NamedTuple):
    main: torch.Tensor
    aux: torch.Tensor


class Nested(nn.Module):
    """``{"pred": (summary, Pair(main, aux))}``: the loss reads ``main``; every leaf is
    gathered, and compared."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> dict[str, tuple[torch.Tensor, Pair]]:
        y = self.net(x)
        return {"pred": (y.sum(-1), Pair(y, 2 * y))}


@dataclass(frozen=True)
class NestedLoss:
    """``loss(output["pred"][1].main, target)``."""

    loss: Callable[[Any, Any], torch.Tensor]

    def __call__(self, output: dict[str, tuple[torch.Tensor, Pair]], target: Any) -> torch.Tensor:
        return self.loss(output["pred"][1].main, target)


def _per_row(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss of each row (mean over its elements): the batch mean of these is the loss."""
    if name == "ce":
        return F.cross_entropy(out, target, reduction="none")
    if name == "mse":
        rows = F.mse_loss(out, target, reduction="none")
    elif name == "l1":
        rows = F.l1_loss(out, target, reduction="none")
    elif name == "smooth_l1":
        rows = F.smooth_l1_loss(out, target, reduction="none")
    else:
        rows = F.binary_cross_entropy_with_logits(out, target, reduction="none")
    return rows.mean(1)


@dataclass(frozen=True)
class ScaledLoss:
    """``scale * loss(output, target)``, mean reduction."""

    name: str
    scale: float

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.name == "token_ce":
            loss = F.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=-100)
        elif self.name == "ce":
            loss = F.cross_entropy(output, target)
        elif self.name == "mse":
            loss = F.mse_loss(output, target)
        elif self.name == "l1":
            loss = F.l1_loss(output, target)
        elif self.name == "smooth_l1":
            loss = F.smooth_l1_loss(output, target)
        else:
            loss = F.binary_cross_entropy_with_logits(output, target)
        return self.scale * loss


class LossHead(nn.Module):
    """``model(x, y) -> (out, loss)``: per-row losses (``mean=False``, exact under any split),
    or the chunk's mean loss (``mean=True``, what check_forward_loss_average measures)."""

    def __init__(self, net: nn.Module, loss: str, scale: float, *, mean: bool) -> None:
        super().__init__()
        self.net, self.loss, self.scale, self.mean = net, loss, scale, mean

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.net(x)
        rows = self.scale * _per_row(self.loss, out, y)
        return out, rows.mean() if self.mean else rows


def head_loss(output: tuple[torch.Tensor, torch.Tensor], target: Any) -> torch.Tensor:
    """The batch mean of the gathered per-row losses of a loss head."""
    del target
    return output[1].mean()


@dataclass
class Scenario:
    spec: Spec
    module: nn.Module  # what the checks receive
    inputs: Any  # x, or (x, y) for a loss head; () for a keyword-only forward
    target: Any  # None for a loss head
    loss_fn: Callable[[Any, Any], torch.Tensor]
    mean_head: nn.Module | None  # the chunk-mean variant of a loss head
    kwargs: dict[str, Any] = field(default_factory=dict)  # keyword-only forward arguments
    positional: Any = None  # the inputs of mean_head (positional even for a keyword-only forward)


def build(spec: Spec | str) -> Scenario:
    """The scenario a spec describes: same weights, data and targets every time."""
    s = Spec.parse(spec) if isinstance(spec, str) else spec
    rng = random.Random(s.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(s.seed)
        net = Net(s)
        with torch.no_grad():
            for p in net.parameters():
                p.mul_(s.g)
            if net.bn is not None and net.bn.running_mean is not None and net.bn.running_var is not None:
                net.bn.running_mean.normal_().mul_(s.g)
                net.bn.running_var.uniform_(0.5, 2.0)
        if "eval" in s.mods:
            net.eval()
        net.to(s.dtype)
        if "frozen-bias" in s.mods:
            # the output bias: the last bias forward uses
            biases = [p for name, p in net.named_parameters() if name.endswith("bias") and not name.startswith("unused.")]
            if biases and sum(p.numel() for p in net.parameters()) > biases[-1].numel():
                biases[-1].requires_grad_(False)
        if "frozen" in s.mods:
            # among the parameters forward uses, leaving at least one trainable
            params = [p for name, p in net.named_parameters() if not name.startswith("unused.")]
            for index in rng.sample(range(len(params)), min(len(params) - 1, rng.randint(1, 2))):
                params[index].requires_grad_(False)
        shape = {"lstm": (s.B, s.T, s.w), "gru": (s.B, s.T, s.w), "attention": (s.B, s.T, s.w), "conv": (s.B, s.w, s.T)}
        if s.kind == "lm":
            x = _tokens(s)
            with torch.no_grad():
                out64 = copy.deepcopy(net).double()(x)
        else:
            x64 = torch.randn(shape.get(s.kind, (s.B, s.w)), dtype=torch.float64) * s.xs
            x = x64.to(s.dtype)
            with torch.no_grad():
                out64 = copy.deepcopy(net).double()(x.double())
        target = _target(s, out64, x)
    if s.head:
        module: nn.Module = LossHead(net, s.loss, s.ls, mean=False)
        mean_head = LossHead(net, s.loss, s.ls, mean=True)
        if s.io & 1:
            return Scenario(s, KeywordOnly(module), (), None, head_loss, mean_head, {"x": x, "y": target}, (x, target))
        return Scenario(s, module, (x, target), None, head_loss, mean_head, positional=(x, target))
    loss_fn: Callable[[Any, Any], torch.Tensor] = ScaledLoss(s.loss, s.ls)
    if s.io & 2:
        body: nn.Module = Nested(net)
        loss_fn = NestedLoss(loss_fn)
    else:
        body = net
    if s.io & 1:
        return Scenario(s, KeywordOnly(body), (), target, loss_fn, None, {"x": x})
    return Scenario(s, body, x, target, loss_fn, None)


def _tokens(s: Spec) -> torch.Tensor:
    """Token ids [rows, T] over o + 2 tokens, every row padded (token 0) after a random
    length of at least one token."""
    tokens = torch.randint(1, s.o + 2, (s.B, s.T))
    lengths = torch.randint(1, s.T + 1, (s.B,))
    return tokens.masked_fill(torch.arange(s.T) >= lengths[:, None], 0)


def _target(s: Spec, out64: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if s.loss == "token_ce":
        # the next token (the model's own choice when near-converged); -100 on padding
        labels = out64.argmax(-1) if s.near else torch.randint(0, s.o + 2, x.shape)
        return labels.masked_fill(x == 0, -100)
    noise = torch.randn(out64.shape, dtype=torch.float64)
    if s.loss == "ce":
        if s.near:
            return out64.argmax(1)
        return torch.randint(0, s.o, (s.B,))
    if s.loss == "bce":
        if s.near:
            return (torch.sigmoid(out64) + s.near * noise).clamp(0, 1).to(s.dtype)
        return torch.rand(out64.shape, dtype=torch.float64).to(s.dtype)
    if s.near:
        return (out64 + s.near * out64.abs() * noise).to(s.dtype)
    typical = float(out64.abs().mean()) or 1.0
    return (typical * noise).to(s.dtype)


# --------------------------------------------------------------------------------------
# Own single-device steps (finiteness, and the float32 step's distance from float64).


def single_step(sc: Scenario, dtype: torch.dtype) -> tuple[float, dict[str, torch.Tensor]]:
    """Forward, loss, backward of a copy alone in ``dtype``: the loss and every gradient."""

    def cast(t: Any) -> Any:
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    model = copy.deepcopy(sc.module).to(dtype)
    args = tuple(cast(a) for a in sc.inputs) if isinstance(sc.inputs, tuple) else (cast(sc.inputs),)
    kwargs = {k: cast(v) for k, v in sc.kwargs.items()}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        loss = sc.loss_fn(model(*args, **kwargs), cast(sc.target))
        loss.backward()
    grads = {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads


def _finite(loss: float, grads: dict[str, torch.Tensor]) -> bool:
    return math.isfinite(loss) and all(bool(g.isfinite().all()) for g in grads.values())


# --------------------------------------------------------------------------------------
# Error injection through a parallel= wrapper.


class InjectingDataParallel(dpverify.VirtualDataParallel[nn.Module]):
    """VirtualDataParallel whose reduced gradient of ``parameter`` is ``g + g * delta``
    (``delta`` a relative error per element, or one number for the whole tensor)."""

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int] | None = None,
        output_device: int | None = None,
        *,
        parameter: str,
        delta: torch.Tensor | float,
    ) -> None:
        super().__init__(module, device_ids, output_device)
        param = module.get_parameter(parameter)
        # A hook on the leaf parameter acts on the gradient after the reduce-add.
        param.register_hook(lambda g: g + g * (delta.to(g.dtype) if isinstance(delta, torch.Tensor) else delta))


def injecting(parameter: str, delta: torch.Tensor | float) -> Callable[..., nn.Module]:
    def wrap(module: nn.Module, device_ids: Sequence[int], output_device: int | None = None) -> nn.Module:
        return InjectingDataParallel(module, device_ids, output_device, parameter=parameter, delta=delta)

    return wrap


@dataclass(frozen=True)
class Injection:
    spec: str
    mode: str  # "whole", "1%", "one"
    eps: float
    bucket: float  # input scale
    caught: bool
    distance: float  # single-device float32 distance from float64 on the tensor, relative
    effective: float  # largest injected change / max|g64|
    parameter: str
    allowed: float  # what the check allowed on that tensor (max abs difference) / max|g64|


# --------------------------------------------------------------------------------------
# Running and counting.


@dataclass(frozen=True)
class Failure:
    outcome: str  # "false alarm" or "crash"
    check: str
    spec: str
    classes: tuple[str, ...]
    kind: str  # what failed, for grouping
    message: str  # one line


@dataclass
class Tally:
    scenarios: int = 0
    passes: int = 0
    false_alarms: int = 0
    crashes: int = 0
    skipped: int = 0  # non-finite loss or gradients in the working dtype: not a valid scenario
    loss_average_checks: int = 0
    ratios: list[float] = field(default_factory=list)
    by_class: dict[str, ClassTally] = field(default_factory=lambda: defaultdict(ClassTally))
    failures: list[Failure] = field(default_factory=list)
    injections: list[Injection] = field(default_factory=list)
    no_gradient_to_perturb: int = 0
    warnings: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0
    cpu_seconds: float = 0.0


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _mismatch_summary(error: dpverify.ParallelMismatch) -> tuple[str, str]:
    """(kind, one line) of a ParallelMismatch: the worst tensor and its numbers."""
    report = error.report
    if isinstance(report, dpverify.StepComparison):
        if report.failures:
            line = report.failures[0].splitlines()[0]
            return f"failure: {line[:60]}", line
        bad = [t for t in report.tensors if not t.ok]
        worst = max(bad, key=lambda t: (t.problem is not None, t.ratio))
        if worst.problem:
            return f"{_tensor_kind(worst.name)} {worst.problem}", f"{worst.name} {worst.problem}"
        ref = "" if worst.reference_error is None else f", single-device {worst.reference_error:.3g} from float64"
        return (
            _tensor_kind(worst.name),
            f"{worst.name}: {worst.mismatched}/{worst.numel} mismatched, max |diff| {worst.max_abs:.3g} "
            f"(allowed {worst.allowed:.3g}, ratio {worst.ratio:.3g}{ref}); {len(bad)} tensor(s) fail",
        )
    return "mismatch", _first_line(error)


def _tensor_kind(name: str) -> str:
    for prefix in ("sum of replica grads", "accumulated grad", "average of replica grads", "grad", "loss", "output"):
        if name.startswith(prefix):
            return prefix
    return name


def _run_check(
    tally: Tally, spec: Spec, check: str, call: Callable[[], dpverify.StepComparison], verbose: bool
) -> tuple[str, float | None]:
    """Runs one check; returns (outcome, worst ratio)."""
    try:
        result = call()
    except dpverify.ParallelMismatch as error:
        kind, line = _mismatch_summary(error)
        tally.failures.append(Failure("false alarm", check, str(spec), tuple(spec.classes), kind, line))
        if verbose:
            print(f"--- {check}: FALSE ALARM\n{error}\n")
        report = error.report
        return "false alarm", report.worst_ratio if isinstance(report, dpverify.StepComparison) else None
    except Exception as error:
        tally.failures.append(Failure("crash", check, str(spec), tuple(spec.classes), type(error).__name__, _first_line(error)))
        if verbose:
            print(f"--- {check}: CRASH")
            traceback.print_exc(file=sys.stdout)
        return "crash", None
    if verbose:
        print(f"--- {check}: {result}")
    return "pass", result.worst_ratio


def run_scenario(spec: Spec, tally: Tally, *, verbose: bool = False) -> str:
    """Builds and checks one scenario; returns its outcome ("pass", "false alarm", "crash",
    "skipped")."""
    started, cpu_started = time.perf_counter(), time.process_time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outcome, ratio = _scenario_checks(spec, tally, verbose)
    for w in caught:
        tally.warnings[f"{w.category.__name__}: {str(w.message).splitlines()[0][:100]}"] += 1
    seconds = time.perf_counter() - started
    tally.seconds += seconds
    tally.cpu_seconds += time.process_time() - cpu_started
    for name in ["all", *spec.classes]:
        ct = tally.by_class[name]
        ct.seconds += seconds
        if outcome == "skipped":
            ct.skipped += 1
            continue
        ct.scenarios += 1
        ct.passes += outcome == "pass"
        ct.false_alarms += outcome == "false alarm"
        ct.crashes += outcome == "crash"
        if ratio is not None:
            ct.ratios.append(ratio)
    if outcome == "skipped":
        tally.skipped += 1
        return outcome
    tally.scenarios += 1
    tally.passes += outcome == "pass"
    tally.false_alarms += outcome == "false alarm"
    tally.crashes += outcome == "crash"
    if ratio is not None:
        tally.ratios.append(ratio)
    return outcome


def _scenario_checks(spec: Spec, tally: Tally, verbose: bool) -> tuple[str, float | None]:
    try:
        sc = build(spec)
        loss, grads = single_step(sc, spec.dtype)
    except Exception as error:
        tally.failures.append(Failure("crash", "build", str(spec), tuple(spec.classes), type(error).__name__, _first_line(error)))
        if verbose:
            traceback.print_exc(file=sys.stdout)
        return "crash", None
    if not _finite(loss, grads):
        if verbose:
            print(f"skipped: the single-device {spec.dt} step is not finite (loss {loss:g})")
        return "skipped", None
    common: dict[str, Any] = {"loss_fn": sc.loss_fn, "device_ids": list(spec.dev), "forward_kwargs": sc.kwargs or None}
    outcomes: list[str] = []
    ratios: list[float] = []
    for check, call in (
        ("assert_dp_grads_match", lambda: dpverify.assert_dp_grads_match(sc.module, sc.inputs, sc.target, output_device=spec.out, **common)),
        ("assert_grad_sum_equals_mean_loss_grad", lambda: dpverify.assert_grad_sum_equals_mean_loss_grad(sc.module, sc.inputs, sc.target, **common)),
    ):
        outcome, ratio = _run_check(tally, spec, check, call, verbose)
        outcomes.append(outcome)
        if ratio is not None:
            ratios.append(ratio)
    if sc.mean_head is not None and spec.even:
        outcomes.append(_loss_average(tally, spec, sc, verbose))
    if spec.sens and outcomes[0] == "pass":
        _sensitivity(tally, spec, sc, grads, verbose)
    worst = "crash" if "crash" in outcomes else "false alarm" if "false alarm" in outcomes else "pass"
    return worst, max(ratios, default=None)


def _loss_average(tally: Tally, spec: Spec, sc: Scenario, verbose: bool) -> str:
    tally.loss_average_checks += 1
    check = "check_forward_loss_average"
    assert sc.mean_head is not None
    try:
        report = dpverify.check_forward_loss_average(sc.mean_head, sc.positional, device_ids=list(spec.dev))
    except Exception as error:
        tally.failures.append(Failure("crash", check, str(spec), tuple(spec.classes), type(error).__name__, _first_line(error)))
        if verbose:
            traceback.print_exc(file=sys.stdout)
        return "crash"
    if verbose:
        print(f"--- {check}:\n{report}\n")
    if report.is_biased:
        line = (
            f"is_biased on chunks {list(report.chunk_sizes)}: loss bias {report.loss_bias:.3g} "
            f"(loss {report.full_batch_loss:.3g}), grad bias {report.grad_bias:.3g}"
        )
        tally.failures.append(Failure("false alarm", check, str(spec), tuple(spec.classes), "is_biased on even chunks", line))
        return "false alarm"
    return "pass"


def _sensitivity(tally: Tally, spec: Spec, sc: Scenario, grads32: dict[str, torch.Tensor], verbose: bool) -> None:
    _, grads64 = single_step(sc, torch.float64)
    candidates = [n for n, g in grads64.items() if float(g.abs().max()) > 0 and n in grads32]
    if not candidates:
        tally.no_gradient_to_perturb += 1
        return
    rng = random.Random(spec.seed + 1)
    name = rng.choice(candidates)
    g64, g32 = grads64[name], grads32[name]
    top = float(g64.abs().max())
    distance = float((g32.double() - g64).abs().max()) / top
    numel = g64.numel()
    chosen = torch.tensor(rng.sample(range(numel), max(1, round(0.01 * numel))))
    largest = int(g64.abs().reshape(-1).argmax())
    share = float(g64.reshape(-1)[chosen].abs().max()) / top
    trials: list[tuple[str, float, torch.Tensor | float, float]] = []
    for eps in EPSILONS:
        trials.append(("whole", eps, eps, eps))
        mask = torch.zeros(numel, dtype=torch.float32)
        mask[chosen] = eps
        trials.append(("1%", eps, mask.reshape(g64.shape), eps * share))
    one = torch.zeros(numel, dtype=torch.float32)
    one[largest] = 1e-4
    trials.append(("one", 1e-4, one.reshape(g64.shape), 1e-4))
    for mode, eps, delta, effective in trials:
        result: object
        try:
            result = dpverify.assert_dp_grads_match(
                sc.module, sc.inputs, sc.target, loss_fn=sc.loss_fn, device_ids=list(spec.dev),
                output_device=spec.out, parallel=injecting(name, delta), forward_kwargs=sc.kwargs or None,
            )
            caught = False
        except dpverify.ParallelMismatch as error:
            result, caught = error.report, True
        allowed = math.nan
        if isinstance(result, dpverify.StepComparison):
            rows = [t for t in result.tensors if t.name == f"grad {name!r}"]
            allowed = rows[0].allowed / top if rows else math.nan
        tally.injections.append(Injection(str(spec), mode, eps, spec.xs, caught, distance, effective, name, allowed))
        if verbose:
            print(
                f"--- injected {mode} {eps:g} into {name!r}: {'caught' if caught else 'MISSED'} (single-device "
                f"distance {distance:.3g}, effective {effective:.3g}, allowed {allowed:.3g} of max|g64|)"
            )


# --------------------------------------------------------------------------------------
# Report.


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def _rate(hits: Sequence[Injection]) -> str:
    if not hits:
        return "-"
    return f"{sum(h.caught for h in hits)}/{len(hits)}"


def report(tally: Tally, seed: int, show: int) -> None:
    n_all = tally.scenarios + tally.skipped
    per = 1000 * tally.seconds / max(n_all, 1)
    cpu = 1000 * tally.cpu_seconds / max(n_all, 1)
    print(f"\n{n_all} scenarios (seed {seed}) in {tally.seconds:.0f} s, {per:.0f} ms per scenario ({cpu:.0f} ms CPU); "
          f"{tally.skipped} skipped (loss or gradients not finite in the working dtype)\n")
    r = tally.ratios
    print("| | count |")
    print("|---|---:|")
    print(f"| scenarios checked | {tally.scenarios} |")
    print(f"| passed | {tally.passes} |")
    print(f"| false alarms (ParallelMismatch or is_biased on correct code) | {tally.false_alarms} |")
    print(f"| crashes (any other exception) | {tally.crashes} |")
    print(f"| loss-average checks (loss head, even chunks) | {tally.loss_average_checks} |")
    print(f"| error / allowed p50 / p99 / p99.9 / max | {_percentile(r, .5):.3g} / {_percentile(r, .99):.3g} / "
          f"{_percentile(r, .999):.3g} / {max(r, default=math.nan):.3g} |")

    inj = tally.injections
    sens_scenarios = len({i.spec for i in inj})
    print(f"\nSensitivity: {sens_scenarios} float32 scenarios (every {SENSITIVITY_EVERY}th that passed), "
          f"{tally.no_gradient_to_perturb} with no nonzero gradient to perturb. Caught / injected "
          "by assert_dp_grads_match, per input scale; the last column keeps the scenarios whose "
          f"single-device float32 step is within {WELL_CONDITIONED:g} (relative) of float64 on the "
          "perturbed tensor. '1%' perturbs random elements; 'one' the largest.\n")
    print("| injected error | " + " | ".join(f"x {b:g}" for b in SCALE_BUCKETS) + " | all | well conditioned | well conditioned, perturbed elements >= 10% of max |")
    print("|---|" + "---:|" * (len(SCALE_BUCKETS) + 3))
    for mode, eps in [*((m, e) for e in EPSILONS for m in ("whole", "1%")), ("one", 1e-4)]:
        rows = [i for i in inj if i.mode == mode and i.eps == eps]
        cells = [_rate([i for i in rows if i.bucket == b]) for b in SCALE_BUCKETS]
        good = [i for i in rows if i.distance <= WELL_CONDITIONED]
        large = [i for i in good if i.effective >= 0.1 * i.eps]
        print(f"| {mode} x(1+{eps:g}) | " + " | ".join(cells) + f" | {_rate(rows)} | {_rate(good)} | {_rate(large)} |")
    distances = [i.distance for i in inj if i.mode == "whole" and i.eps == EPSILONS[0]]
    if distances:
        well = sum(d <= WELL_CONDITIONED for d in distances)
        print(f"\nSingle-device float32 distance from float64 on the perturbed tensor: p50 {_percentile(distances, .5):.3g}, "
              f"p90 {_percentile(distances, .9):.3g}, max {max(distances):.3g}; {well}/{len(distances)} within {WELL_CONDITIONED:g}.")
    allowed = [i.allowed for i in inj if i.mode == "whole" and i.eps == EPSILONS[0] and i.distance <= WELL_CONDITIONED]
    if allowed:
        print(f"Allowed difference on the perturbed tensor, relative to its largest entry (well-conditioned tensors): "
              f"min {min(allowed):.3g}, p50 {_percentile(allowed, .5):.3g}, p90 {_percentile(allowed, .9):.3g}, max {max(allowed):.3g}.")
    target = [i for i in inj if i.eps == 1e-5 and i.mode in ("whole", "1%") and i.distance <= WELL_CONDITIONED]
    print(f"Target (1e-5, whole tensor or 1% of it, well conditioned): {_rate(target)} caught; "
          f"one element x(1+1e-4): {_rate([i for i in inj if i.mode == 'one'])} caught.")

    print("\nPer class (a scenario counts in each of its classes):\n")
    print("| class | scenarios | passed | false alarms | crashes | skipped | p50 | p99 | p99.9 | max | ms/scenario |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in sorted(tally.by_class, key=lambda k: (k != "all", k)):
        ct = tally.by_class[name]
        q = ct.ratios
        ms = 1000 * ct.seconds / max(ct.scenarios + ct.skipped, 1)
        print(f"| {name} | {ct.scenarios} | {ct.passes} | {ct.false_alarms} | {ct.crashes} | {ct.skipped} | "
              f"{_percentile(q, .5):.3g} | {_percentile(q, .99):.3g} | {_percentile(q, .999):.3g} | "
              f"{max(q, default=math.nan):.3g} | {ms:.0f} |")

    if tally.failures:
        kinds: dict[tuple[str, str, str], list[Failure]] = defaultdict(list)
        for f in tally.failures:
            kinds[(f.outcome, f.check, f.kind)].append(f)
        print(f"\nFailures: {len(tally.failures)} in {tally.false_alarms + tally.crashes} scenarios, {len(kinds)} distinct kinds\n")
        for (outcome, check, kind), items in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
            classes = Counter(c for f in items for c in f.classes if c.startswith(("kind:", "dtype:")))
            top = ", ".join(f"{c} {n}" for c, n in classes.most_common(6))
            print(f"- {outcome}, {check}, {kind}: {len(items)} ({top})")
            for f in items[:show]:
                print(f"    {f.spec}\n      {f.message}")
    missed = [i for i in inj if not i.caught and i.distance <= WELL_CONDITIONED and i.eps >= 1e-5 and i.mode != "1%"]
    if missed and show:
        print("\nMissed injections (1e-5 or more, whole tensor or largest element, well-conditioned tensor):")
        for i in missed[:show]:
            print(f"    {i.mode} {i.eps:g} in {i.parameter!r} (distance {i.distance:.3g}, allowed {i.allowed:.3g}): {i.spec}")
    if tally.warnings:
        print("\nWarnings raised during the checks:")
        for text, count in tally.warnings.most_common(10):
            print(f"    {count} x {text}")


def main(argv: Sequence[str] | None = None) -> Tally:
    tally = Tally()
    return drive(  # type: ignore[no-any-return]
        argv, description=(__doc__ or "").splitlines()[0], scenarios=10_000, tally=tally, generate=generate,
        parse=Spec.parse, run=lambda spec, verbose: run_scenario(spec, tally, verbose=verbose),
        report=lambda seed, show: report(tally, seed, show),
        describe=lambda spec: f"classes: {', '.join(spec.classes)}; chunks {spec.chunks}",
        progress=lambda: f"{tally.false_alarms} false alarms, {tally.crashes} crashes, {tally.skipped} skipped, {tally.seconds:.0f} s",
        show="failing specs listed per kind of failure (default 20)",
    )


if __name__ == "__main__":
    main()
