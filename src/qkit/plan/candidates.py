"""The planner's candidates: for one quantized tensor, every type an output format can store it in, with the
exact bytes that format writes for it.

``qkit plan`` picks one candidate per tensor so that the stored bytes fit a budget; a plan is only as good
as these numbers, so each one is the byte count the format's own writer produces (every stored part:
codes, scales, minimums, global scales, shape tensors; the tests compare each with a written file).

A candidate is offered for a ``[out, in]`` tensor only where the shape takes it **natively**: never through
a width fallback (a k-quant on a width that is not a multiple of 256 is written as another type,
``Scheme.resolve``), never with a short last group, so the plan names exactly the type that is stored.
``KEEP`` (``"none"``, the word of ``--keep none:GLOB``) keeps the tensor unquantized in the source dtype.

**gguf** (``qkit.export.gguf``; llama.cpp loads any per-tensor type): the ladder of ``llama-quantize``
types qkit writes, ``q2_k q3_k iq4_xs q4_k q5_k q6_k`` (``in % 256 == 0``), ``q4_0 iq4_nl q4_1 q5_0 q5_1
q8_0`` (``in % 32 == 0``), and KEEP. Bytes: ``out * in / block * type_size``
(``gguf.GGML_QUANT_SIZES``, ``export.gguf.types.tensor_nbytes``), which is also the scheme's
``nbytes_for`` and the GGUF tensor's ``n_bytes``. KEEP is the source's float type as the GGUF writer stores
it (F32 for an fp32 model, F16 / BF16 for those), ``out * in * itemsize``. ``f16`` for an fp32 source is
not offered: qkit's GGUF writer never converts a kept tensor. Nor is ``mxfp4`` (GGUF's MXFP4, which qkit
can write): llama-quantize offers it only as the MoE-expert ftype ``MXFP4_MOE``.

**compressed-tensors** (``qkit.export.compressed_tensors``, ``compressed_tensors_fp4``): ``int4-g32
int4-g64 int4-g128`` (the group divides ``in``), ``int4-row``, ``int8-row``, ``nvfp4`` (``in % 16``),
``mxfp4`` (``in % 32``), and KEEP. compressed-tensors 0.20.1 itself accepts any positive group size
(``QuantizationArgs``: ``group_size > 0`` with ``strategy: group``, ``-1`` / channel); the groups offered
are those vLLM's mixed-precision weight-only kernels serve (Marlin's ``MARLIN_SUPPORTED_GROUP_SIZES``:
-1, 32, 64, 128). A mix of FP4 and int groups is written as ``mixed-precision``. Bytes
(``compressed_tensors.stored_nbytes``), with ``weight_scale`` in the **weight's** dtype::

    int:    out * ceil(in * bits / 32) * 4  +  out * (in / group, or 1 per row) * itemsize(dtype)  +  16
    nvfp4:  out * in / 2  +  out * in / 16  +  4            mxfp4:  out * in / 2  +  out * in / 32

KEEP: ``M.weight`` as read, ``out * in * itemsize(dtype)``. An int candidate whose scale dtype the weight
dtype cannot hold exactly (fp16 scales on a bf16 model) is refused, as the exporter refuses it.

**qkit** (``checkpoint.ShardWriter``): every registered scheme that is not a recipe (``scheme_names()``),
plus the groups ``int4-g32 int4-g64 int8-g32 int8-g64 int8-g128``, each where the shape takes it natively
(blocks and groups divide ``in``; nf4's flat blocks of 64 take any shape), and KEEP. Bytes: what the
writer stores for the ``QuantizedTensor``, ``sum(bytes of qt.tensors(name))`` = the bytes of
``scheme.part_layout(shape)`` (``QuantizedTensor.from_parts`` refuses parts that differ from it), which
equals ``scheme.nbytes_for(shape)`` for every native shape (the llama.cpp types store an empty ``scales``);
absmax and nf4 scales are in ``scale_dtype``. KEEP: ``out * in * itemsize(dtype)``.

**Fused layers** (``fused_groups``): vLLM serves a llama-style model's q/k/v projections as one
``qkv_proj`` and gate/up as one ``gate_up_proj``, and refuses a compressed-tensors checkpoint whose shards
of one fused layer have different schemes ("vLLM requires all to use the same scheme", or no matching
config group). A compressed-tensors plan therefore gives each such group one type; gguf (llama.cpp keeps
every tensor separate) and qkit plan each tensor alone.

Candidates are listed by bytes, then name; ``ladder`` lists a format's names by their bytes on a
``[4096, 4096]`` fp16 tensor with fp16 scales, KEEP last.
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from qkit.errors import InputError, SchemeError
from qkit.export import QKIT_PLAN_GROUPS, Format, formats_that, get_format
from qkit.export.common import dtype_name
from qkit.export.compressed_tensors import PLAN_GROUPS as CT_GROUPS
from qkit.export.compressed_tensors import PLAN_TYPES as CT_TYPES
from qkit.export.gguf.types import PLAN_TYPES as GGUF_TYPES
from qkit.granularity import PerGroup
from qkit.schemes import AbsmaxScheme, get_scheme, scheme_names
from qkit.schemes.base import Recipe, Scheme
from qkit.schemes.registry import DEFAULT_SCALE_DTYPE, parse_scale_dtype
from qkit.transform import FUSED_MODULES, KEEP_ORIGINAL, fused_key

KEEP = KEEP_ORIGINAL  # "none": the candidate that keeps a tensor unquantized in the source dtype
_SOURCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LADDER_SHAPE = (4096, 4096)  # the shape ``ladder`` orders by: every candidate fits it natively
_FLOAT_WORDS = ("f32", "f16", "bf16", "fp32", "fp16", "float32", "float16", "bfloat16", "keep")


@dataclass(frozen=True)
class Candidate:
    """One type a format can store a tensor in: ``name`` (the scheme name, or ``KEEP``), ``scheme`` (None for
    ``KEEP``) and ``nbytes``, the exact bytes the format stores for that tensor (every stored part)."""

    name: str
    scheme: Scheme | None
    nbytes: int


def plan_formats() -> tuple[str, ...]:
    """The formats a plan can be written for: every registered format (``export.format_names``) that mixes types."""
    return formats_that(lambda fmt: bool(fmt.plan_types()))


def plan_format(format: str) -> Format:
    """The format the planner plans for called ``format`` (``ct``: compressed-tensors); ``InputError`` (one line)
    for an unknown name (the registry's words: ``export.get_format``) and for a format that stores one type
    (bitsandbytes)."""
    fmt = get_format(format)
    if not fmt.plan_types():
        raise InputError(f"--format {fmt.name} stores one type ({fmt.help}) and cannot mix types; "
                         f"plan for {', '.join(plan_formats())}")
    return fmt


def check_format(format: str) -> str:
    """The registered name of the format the planner plans for (``plan_format``)."""
    return plan_format(format).name


@functools.cache
def _scheme(name: str, scale_dtype: torch.dtype) -> Scheme:
    return get_scheme(name, scale_dtype)


def native(format: str, scheme: Scheme, shape: tuple[int, int]) -> bool:
    """Whether ``format`` stores a ``shape`` weight as ``scheme`` itself (``Format.supports``): no width
    fallback, whole blocks along each row, and no short last group."""
    return plan_format(format).supports(scheme, shape)


def stored_nbytes(fmt: str, scheme: Scheme | None, shape: tuple[int, int], dtype: torch.dtype) -> int:
    """Exact stored bytes of a ``shape`` tensor of source ``dtype`` in format ``fmt`` (``scheme`` None: KEEP)."""
    return plan_format(fmt).stored_nbytes(scheme, shape, dtype)


def fused_groups(format: str, names: Sequence[str]) -> list[list[int]]:
    """Indices into ``names`` that must share one type in ``format``, in order of first appearance: for
    compressed-tensors, the shards of one fused vLLM layer (``transform.fused_key``: ``...self_attn.{q,k,v}_proj.weight``
    of one layer; ``...mlp.{gate,up}_proj.weight``); every other tensor, and every tensor of other formats, alone."""
    if not plan_format(format).ties_fused:
        return [[i] for i in range(len(names))]
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        key = fused_key(name)
        groups.setdefault(f"\0{name}" if key is None else key, []).append(i)  # \0: never a tensor's name
    return list(groups.values())


@functools.cache
def ladder(format: str) -> tuple[str, ...]:
    """Every candidate name ``format`` can offer (for help and validation), smallest first: by bytes on a
    ``[4096, 4096]`` fp16 tensor with fp16 scales (ties by name), ``KEEP`` last."""
    fmt = check_format(format)
    fp16 = parse_scale_dtype(DEFAULT_SCALE_DTYPE)
    size = {n: stored_nbytes(fmt, _scheme(n, fp16), _LADDER_SHAPE, torch.float16) for n in plan_format(fmt).plan_types()}
    return (*sorted(size, key=lambda n: (size[n], n)), KEEP)


def parse_allowed(format: str, words: Sequence[str]) -> tuple[str, ...]:
    """Validate ``--candidates`` words (each may hold several, split at commas and spaces; any case) against
    ``format``'s ladder; returns the chosen names in ladder order, each once. ``InputError`` (one line) for an
    unknown word (with "did you mean"), a scheme the format does not offer (naming its ladder), or no word."""
    fmt = check_format(format)
    names = ladder(fmt)
    listed = ", ".join(names)
    offers = f"--format {fmt} offers: {listed}"
    chosen: set[str] = set()
    for word in [w for item in words for w in re.split(r"[,\s]+", str(item)) if w]:
        key = word.strip().lower()
        if key in names:
            chosen.add(key)
            continue
        if key in _FLOAT_WORDS:
            raise InputError(f"candidate {word!r}: a tensor kept unquantized is the candidate {KEEP} (stored in the "
                             f"source dtype, never converted); {offers}")
        try:
            scheme = get_scheme(key)
        except SchemeError:
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.6) or difflib.get_close_matches(
                key, scheme_names(), n=1, cutoff=0.6)
            guess = f"did you mean {close[0]}? " if close else ""
            raise InputError(f"unknown candidate {word!r}; {guess}{offers}") from None
        if isinstance(scheme, Recipe):
            why = "is a recipe (a fixed mix of types), and the plan chooses each tensor's type itself"
        elif isinstance(scheme, AbsmaxScheme) and isinstance(scheme.granularity, PerGroup):
            why = "is a group size the plan does not offer (groups of 32, 64 or 128)"
        else:
            why = "is not a type it can mix"
        raise InputError(f"candidate {scheme.name} {why} for --format {fmt}; it offers: {listed}")
    if not chosen:
        raise InputError(f"--candidates names no candidate; give some of what {offers}")
    return tuple(n for n in names if n in chosen)


def candidates(
    format: str,
    shape: tuple[int, int],
    dtype: torch.dtype,
    *,
    allowed: Sequence[str] | None = None,
    scale_dtype: str = DEFAULT_SCALE_DTYPE,
) -> list[Candidate]:
    """The candidates ``format`` offers a ``[out, in]`` tensor of source ``dtype`` (fp32, fp16 or bf16), by
    ``nbytes`` ascending, then name: every name of ``ladder(format)`` the shape takes natively (module
    docstring), restricted to ``allowed`` (``--candidates`` words, checked by ``parse_allowed``) when given.

    ``scale_dtype``: the scale type of the schemes with a free one (``--scale-dtype``; it changes qkit's
    absmax/nf4 bytes, not compressed-tensors', which stores scales in the weight dtype). ``InputError`` (one
    line) for a bad format, shape or dtype, for compressed-tensors int candidates whose scales ``dtype``
    cannot hold, and when no allowed candidate fits the shape (naming what would)."""
    fmt = check_format(format)
    if len(shape) != 2 or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape):
        raise InputError(f"a planned tensor must be 2-D [out, in] with positive sizes, not {list(shape)}")
    shape = (int(shape[0]), int(shape[1]))
    if dtype not in _SOURCE_DTYPES:
        raise InputError(f"a planned tensor's source dtype must be float32, float16 or bfloat16, not {dtype_name(dtype)}")
    sdtype = parse_scale_dtype(scale_dtype)
    wanted = set(ladder(fmt) if allowed is None else parse_allowed(fmt, allowed))
    holder = plan_format(fmt)
    fits: list[Candidate] = []
    for name in ladder(fmt):
        scheme = None if name == KEEP else _scheme(name, sdtype)
        if scheme is not None and not holder.supports(scheme, shape):
            continue
        fits.append(Candidate(name, scheme, holder.stored_nbytes(scheme, shape, dtype)))
    out = sorted((c for c in fits if c.name in wanted), key=lambda c: (c.nbytes, c.name))
    holder.check_candidates([c.scheme for c in out if c.scheme is not None], dtype, sdtype)
    if not out:
        what = ", ".join(c.name for c in sorted(fits, key=lambda c: (c.nbytes, c.name)))
        raise InputError(
            f"no allowed candidate ({', '.join(n for n in ladder(fmt) if n in wanted)}) fits a {list(shape)} tensor "
            f"in --format {fmt}; what fits: {what}; add one of them to --candidates"
        )
    return out


__all__ = ["CT_GROUPS", "CT_TYPES", "FUSED_MODULES", "fused_groups", "GGUF_TYPES", "KEEP", "Candidate",
           "candidates", "check_format", "ladder", "plan_format", "native", "parse_allowed", "plan_formats", "stored_nbytes"]
