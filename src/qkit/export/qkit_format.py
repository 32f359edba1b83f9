"""qkit's own format (``--format qkit``, the default): a safetensors directory written by ``checkpoint.ShardWriter``.

A registered ``Format`` like the export formats (``export/__init__.py`` registers it first), so nothing
asks for it by name: it stores every scheme as its parts (``Scheme.part_layout``), the manifest in every
shard's metadata (``transform.new_manifest``), and a ``quantization_config`` with ``quant_method: qkit``
that repeats the manifest's scheme, rules, method and plan. It has no target library, so ``qkit verify``
has nothing to compare it with (``reader``: None); qkit reads it back itself (``checkpoint.iter_quantized``),
which is what the torch engine streams into the reference model, and ``decode`` reads one weight's parts
back given the shape the manifest records (the parts alone do not hold it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from qkit.checkpoint import DEFAULT_MAX_SHARD_BYTES, ShardWriter
from qkit.errors import ExportError, QkitError
from qkit.export.common import Format, PreparedExport, SafetensorsFormat
from qkit.models import ModelRef, read_config
from qkit.schemes import QuantizedTensor, Scheme, get_scheme, scheme_names
from qkit.schemes.base import Recipe
from qkit.schemes.iquants3 import GridScheme
from qkit.schemes.tquants import TernaryScheme
from qkit.transform import MANIFEST_FORMAT
from qkit.version import __version__

NAME = MANIFEST_FORMAT  # "qkit": config.json's quant_method, the manifest's format and the --format word
# Group sizes qkit's own format offers a plan beside the registered schemes (int4-g128 is one of those).
PLAN_GROUPS = ("int4-g32", "int4-g64", "int8-g32", "int8-g64", "int8-g128")


def checkpoint_config(manifest: dict) -> dict:
    """The ``quantization_config`` of a qkit checkpoint: ``quant_method: qkit``, the manifest's version, default
    scheme and rules, and the method and plan when the manifest records them."""
    return {
        "quant_method": NAME,
        "format_version": manifest["format_version"],
        "qkit_version": __version__,
        "scheme": manifest["scheme"],
        "rules": manifest["rules"],
        **({"method": manifest["method"]} if "method" in manifest else {}),
        **({"plan": manifest["plan"]} if "plan" in manifest else {}),
    }


@dataclass
class PreparedCheckpoint(PreparedExport):
    """qkit's own prepared output: nothing to check, the manifest (the choice's own, so a method's record
    reaches it) written into every shard and into ``config.json``."""

    def writer(self, directory: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> ShardWriter:
        return ShardWriter(directory, self.manifest, max_shard_bytes)

    def quantization_config(self) -> dict:
        return checkpoint_config(self.manifest)


class QkitFormat(SafetensorsFormat):
    """``--format qkit``: every scheme, stored as its parts, in qkit's own safetensors directory."""

    name = NAME
    library = "qkit"
    help = "every scheme, as qkit's own safetensors directory"
    stores_llama_types = True  # every scheme: llama.cpp's block types and recipes too
    torch_loads = True  # checkpoint.iter_quantized streams it into the reference model
    written_as = ""  # the default format, every torch row's: a status line names no format for it

    def plan_types(self) -> tuple[str, ...]:
        """Every scheme but the recipes (mixes, not types), the ternary ones (``TernaryScheme``) and the grid
        i-quants (``GridScheme``: no GPTQ observer to price them for), then groups."""
        return (*(n for n in scheme_names() if not isinstance(get_scheme(n), (Recipe, TernaryScheme, GridScheme))),
                *PLAN_GROUPS)

    def takes_plan(self, planned: Format) -> bool:
        return True  # it stores whatever types a plan for any format chose

    def prepare(self, directory: Path, targets: dict[str, Scheme], shapes: dict[str, tuple[int, ...]],
                manifest: dict, *, ref: ModelRef | None = None) -> PreparedCheckpoint:
        return PreparedCheckpoint(self, None, manifest)

    def recognises(self, path: Path) -> bool:
        """A directory whose ``config.json`` declares ``quant_method: qkit``."""
        try:
            qc = read_config(Path(path)).get("quantization_config") if Path(path).is_dir() else None
        except (QkitError, OSError, ValueError):  # no, or an unreadable, config.json: not a checkpoint of ours
            return False
        return isinstance(qc, dict) and qc.get("quant_method") == NAME

    def encode(self, name: str, qt: QuantizedTensor) -> dict[str, torch.Tensor]:
        """The scheme's parts as they are (``W.qweight``, ``W.scales``, ...): what ``ShardWriter`` stores."""
        return qt.tensors(name)

    def decode(self, tensors: dict[str, torch.Tensor], scheme: Scheme, dtype: torch.dtype, *,
               shape: tuple[int, ...] | None = None) -> QuantizedTensor:
        """Inverse of ``encode``: one weight's parts (``weight.qweight``, ``weight.scales``, ...: keys without the
        module prefix), checked against what ``scheme`` stores for a ``shape`` weight. The parts do not hold the
        shape (an int4 weight's codes are one run of bytes: a ``[8, 512]`` and a ``[1, 4096]`` int4-tensor weight
        store the same parts), so ``shape`` is required: the manifest's, as ``checkpoint.iter_quantized`` reads it."""
        if shape is None:
            raise ExportError(f"a {self.name} checkpoint's {scheme.name} parts do not hold the weight's shape; pass "
                              "the shape its manifest records (checkpoint.iter_quantized reads the whole checkpoint)")
        parts = {key.rpartition(".")[2]: t for key, t in tensors.items()}
        return QuantizedTensor.from_parts(scheme, parts, tuple(shape), dtype)

    # What qkit verify asks of a format that has a target library (``infer_scheme``, ``stored_parts``) is never
    # asked of this one: ``reader`` is None. qkit reads it back itself, with the manifest's shapes
    # (``checkpoint.iter_quantized``, the same parts ``decode`` takes).
    def reader(self, quantization_config: dict) -> None:
        return None  # no target library reads it: qkit verify has nothing to compare it with


FORMAT = QkitFormat()

__all__ = ["FORMAT", "NAME", "PLAN_GROUPS", "PreparedCheckpoint", "QkitFormat", "checkpoint_config"]
