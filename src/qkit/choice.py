"""One place decides each tensor's type: every way of choosing it compiled, once, before any work.

Layer 7 (beside ``api``, which consumes it). A user picks a tensor's type five ways: the default scheme
with ``--include``/``--exclude``/``--keep`` rules (``transform.Rules``), ``--tensor-type`` overrides in
llama.cpp's terms (``transform.TensorTypes``), a recipe (``q4_k_m``, bound to the model's config), a plan
(``--plan FILE`` or ``--target-bits``: ``qkit.plan``), and ``--imatrix`` (which weights llama.cpp's
searches and turns a recipe's IQ4 choices). Beside the types, the method that chooses the codes and its
typed options. Two steps compile all of it:

1. ``request(options)``: what the options ask, each part parsed and checked in one line before any file
   of the model is read (scheme, rules, method and its typed options, overrides against the format, the
   plan file, the importance-matrix file, activations), and the combinations that cannot go together;
2. ``compile_choice(request, ref, shapes, config, plan)``: with the model's headers and config, one
   ``Choice``: tensor -> scheme (in the order the mechanisms apply: rules, then a plan instead of them,
   then ``--tensor-type``), the importance vectors, nvfp4's fused groups' shared maxima (``shared_amax``), and
   the manifest's record of how the types were chosen.

``api.quantize_model`` is then a pipeline: resolve the model clear of the output, plan first when the
options ask it (``PlanOptions``: ``api._plan_first``), compile the ``Choice``, prepare the output, run the
method, write.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
import torch

from qkit.checkpoint import DEFAULT_MAX_SHARD_BYTES, tensor_dtypes, tensor_reader
from qkit.errors import ExportError, InputError, QkitError
from qkit.export import QKIT, activation_format, formats_that, get_format
from qkit.head_types import WHOLE_FILE, Heads, unweighted
from qkit.methods import RTN, CalibratedOptions, Method, get_method, make_options
from qkit.methods.calibration import check_fits
from qkit.methods.expert_storage import virtual_experts
from qkit.methods.experts import check_method, fused_modules
from qkit.methods.imatrix import Imatrix, gguf_names, imatrix_record, quant_weights_for, unreached_experts
from qkit.methods.imatrix import read as read_imatrix
from qkit.methods.imatrix.method import ImatrixMethod
from qkit.methods.memory import BASELINE, Model, Need, check_need, quantized_bytes, stream_parts
from qkit.memory import check_bytes
from qkit.models import ModelRef
from qkit.plan import KEEP, Plan, PlanOptions, base_type, check_plan_matches, read_plan
from qkit.plan.planfile import PLAN_METHODS
from qkit.schemes import Recipe, Scheme, get_scheme, is_llama_type
from qkit.schemes.ggml import needs_importance
from qkit.schemes.recipes import tensor_category
from qkit.schemes.base import GroupScaled
from qkit.schemes.registry import DEFAULT_SCALE_DTYPE, DEFAULT_SCHEME
from qkit.transform import Rules, TensorTypes, assign_schemes, fused_groups, new_manifest, shapes_fingerprint


@dataclass(frozen=True)
class QuantizeOptions:
    """What ``quantize_model`` writes and how; every default defined here, once.

    ``scheme`` the default scheme of the block projections (``qkit.schemes``), ``scale_dtype`` its scale
    type; ``include`` / ``exclude`` globs and ``keep`` ``SCHEME:GLOB`` overrides (``qkit.transform.Rules``);
    ``format`` a registered format (``qkit.export.format_names()``: ``qkit``'s own or an export format) and
    ``activations`` what it declares for run-time activation quantization (``int8-token``: W8A8
    compressed-tensors); ``method`` how
    the codes are chosen (``qkit.methods``) with ``method_options`` (its options dataclass's fields, or the
    dataclass itself); ``max_shard_bytes`` the largest output shard; ``device`` where the weights are
    quantized; ``allow_pickle`` / ``trust_remote_code`` what the model may run; ``force`` replace an output
    qkit wrote. ``imatrix``: an importance-matrix file (llama-imatrix's GGUF or legacy ``.dat``, or
    ``qkit imatrix``'s) that llama.cpp's block types quantize through (``quantize_row_*_impl``);
    ``tensor_types``: ``PATTERN=TYPE`` overrides in ``llama-quantize --tensor-type``'s terms
    (``qkit.transform.TensorTypes``). ``token_embedding_type`` / ``output_tensor_type``: llama-quantize's
    ``--token-embedding-type`` / ``--output-tensor-type`` over a recipe's whole file (``qkit.head_types``: a
    ggml type, or ``f32``/``f16``/``bf16`` to keep the tensor unquantized in that dtype). ``plan``: a plan file or ``Plan`` to write, or ``PlanOptions`` to plan
    first (``quantize --target-bits``). ``max_memory``: the bytes the quantize may peak at (``--max-memory``;
    None: what is available); a step whose estimate (``check_memory``) is above it is refused before any work.
    ``emit_tensor_types``: where to write, once the checkpoint is in place, the ``llama-quantize
    --tensor-type-file`` that gives every quantized tensor the type qkit gave it (llama.cpp's types of a
    llama or qwen2 model; ``writing.emit_tensor_types``).
    """

    scheme: str = DEFAULT_SCHEME
    scale_dtype: str = DEFAULT_SCALE_DTYPE
    include: Sequence[str] = ()
    exclude: Sequence[str] = ()
    keep: Sequence[str] = ()
    format: str = QKIT
    activations: str | None = None
    method: str = RTN
    method_options: Mapping[str, object] | CalibratedOptions | None = None
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    device: str | None = "cpu"
    allow_pickle: bool = False
    trust_remote_code: bool = False
    force: bool = False
    imatrix: str | None = None
    tensor_types: Sequence[str] = ()
    plan: str | Path | Plan | PlanOptions | None = None
    max_memory: int | None = None
    token_embedding_type: str | None = None
    output_tensor_type: str | None = None
    emit_tensor_types: str | Path | None = None

    def calibration(self) -> str | None:
        """The calibration file the method options name (an input the output must stay clear of), or None."""
        given = self.method_options
        cal = given.get("calibration") if isinstance(given, Mapping) else getattr(given, "calibration", None)
        return None if cal is None else str(cal)


@dataclass(frozen=True)
class Request:
    """What ``QuantizeOptions`` ask, parsed and checked before the model is read (``request``)."""

    default: Scheme  # the default scheme, not yet bound to the model's config
    rules: Rules
    method: Method | None  # None: rtn (streamed)
    method_options: CalibratedOptions | None  # the method's options dataclass, validated; None for rtn
    overrides: TensorTypes
    plan: Plan | PlanOptions | None  # a plan read and checked, or options to plan first with
    matrix: Imatrix | None  # the importance matrix read (``qkit.methods.imatrix``), or None
    format: str
    activations: str | None
    max_memory: int | None = None
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    device: str | None = "cpu"
    heads: Heads = Heads()  # --token-embedding-type / --output-tensor-type

    @property
    def weighted(self) -> bool:
        """Whether llama.cpp's types are quantized through an importance matrix (a file, or collected)."""
        return self.matrix is not None or isinstance(self.method, ImatrixMethod)


@dataclass
class Choice:
    """Every quantized tensor's scheme and how it was chosen: what ``quantize_model`` writes."""

    default: Scheme  # bound to the model's config (a recipe's layer count), or a plan's base type
    rules: Rules
    targets: dict[str, Scheme]  # tensor -> scheme (a recipe resolves per tensor when it is written)
    llama_names: dict[str, str]  # Hugging Face name -> llama.cpp's ({} for a model llama.cpp does not name)
    weights: dict[str, torch.Tensor]  # tensor -> importance vector (``--imatrix``)
    plan: Plan | None
    manifest: dict = field(default_factory=dict)  # the record the writers store (rules, plan, imatrix)
    notes: list[str] = field(default_factory=list)  # what the user should know of the inputs (shown by the CLI)
    kept_dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # kept unquantized, stored in this dtype (f16)
    # tensor -> its fused group's largest max |w| (nvfp4: ``shared_amax``), whose global scale the group shares
    tensor_amax: dict[str, torch.Tensor] = field(default_factory=dict)

    def likely_cause(self, name: str, scheme: str, method: str) -> str | None:
        """What most likely made ``name``'s codes (of type ``scheme``) degenerate, for ``check_written``'s
        refusal: the importance matrix entry that weighted its search, the method that chose its codes,
        else None (the scheme itself: ``check_written`` says so)."""
        qw = self.weights.get(name)
        if qw is not None:
            imatrix = (self.manifest.get("imatrix") or {}).get("file") or "the importance matrix"
            return (f"{imatrix}'s entry for it (values {float(qw.min()):.3g} to {float(qw.max()):.3g}), which weights "
                    f"{scheme}'s search; collect the matrix again or --exclude the tensor")
        if method != RTN:
            return f"the codes {method} chose; compare --method rtn"
        return None


def request(opts: QuantizeOptions) -> Request:
    """Parse and check ``opts`` before any file of the model is read; ``InputError`` (one line) for a bad
    part or a combination that cannot go together."""
    default = get_scheme(opts.scheme, opts.scale_dtype)
    rules = Rules.parse(opts.include, opts.exclude, opts.keep, opts.scale_dtype)
    fmt = get_format(opts.format)
    if opts.activations is not None:  # only a format with a W8A8 variant can declare them
        activation_format(fmt.name, opts.activations)
    method = get_method(opts.method)
    given = opts.method_options
    if method is None and _names_dtype(given) and not isinstance(opts.plan, PlanOptions):  # a plan first runs it
        raise InputError("--dtype sets what the model runs in while a calibrated --method (gptq, imatrix) or a "
                         "--target-bits plan runs it; rtn streams the weights and never runs the model: drop --dtype")
    typed = None
    if method is not None:
        typed = given if isinstance(given, method.options_type) else make_options(method, given)
    overrides = TensorTypes.parse(opts.tensor_types)
    overrides.check_format(fmt.name, fmt.stores_llama_types, formats_that(lambda f: f.stores_llama_types))
    heads = Heads.parse(opts.token_embedding_type, opts.output_tensor_type)
    if opts.plan is None:  # with a plan: refused there, in the plan's words
        heads.check_scheme(default)
    if isinstance(default, Recipe) and (why := fmt.refusal(default)):
        raise ExportError(why)  # a recipe's whole file in a format without llama.cpp's types: said of the recipe
    planned = _plan_request(opts)
    matrix = read_imatrix(opts.imatrix) if opts.imatrix is not None else None  # a malformed file: refused now
    if matrix is not None and method is not None and method.name != "gptq":  # gptq: the matrix weights its scale search
        raise InputError(f"--imatrix weights llama.cpp's own searches (--method rtn or gptq); {method.name} chooses the codes "
                         "itself: drop one of them")
    if method is None and given:
        flags = ", ".join("--" + k.replace("_", "-") for k in sorted(given))
        raise InputError(f"{flags} {'needs' if len(given) == 1 else 'need'} a calibrated --method (gptq, awq, ...)")
    if opts.max_memory is not None and not (isinstance(opts.max_memory, int) and not isinstance(opts.max_memory, bool)
                                            and opts.max_memory > 0):
        raise InputError(f"--max-memory must be a positive number of bytes, got {opts.max_memory!r}")
    if opts.max_memory is not None:
        check_bytes(opts.max_memory, "--max-memory")  # the upper bound: 1 EiB
    check_bytes(opts.max_shard_bytes, "--max-shard-size")
    return Request(default, rules, method, typed, overrides, planned, matrix, fmt.name, opts.activations, opts.max_memory,
                   opts.max_shard_bytes, opts.device, heads)


def _names_dtype(given: Mapping[str, object] | CalibratedOptions | None) -> bool:
    """Whether method options given by name (``--dtype``: ``{"dtype": ...}``) set the dtype the model runs in."""
    return isinstance(given, Mapping) and given.get("dtype") is not None


def _plan_request(opts: QuantizeOptions) -> Plan | PlanOptions | None:
    planned = opts.plan
    if planned is None:
        return None
    if opts.keep or opts.tensor_types or opts.include or opts.exclude:
        raise InputError("a plan sets every planned tensor's type; drop --keep/--tensor-type/--include/--exclude "
                         "(plan with --include/--exclude instead)")
    if opts.token_embedding_type is not None or opts.output_tensor_type is not None:
        raise InputError("a plan sets every planned tensor's type; drop --token-embedding-type/--output-tensor-type "
                         "(plan the embedding with --include instead)")
    if isinstance(planned, (str, Path)):
        planned = read_plan(planned)  # a malformed file: refused now
    if isinstance(planned, Plan) and not get_format(opts.format).takes_plan(get_format(planned.format)):
        raise InputError(f"the plan was made for --format {planned.format}: its types and byte counts are that format's; "
                         f"write it with --format {planned.format} (or re-plan for {opts.format})")
    if isinstance(planned, PlanOptions):
        planned.check()
        default = PlanOptions()
        theirs = [f for f in QUANTIZE_RUNS_PLAN if getattr(planned, f) != getattr(default, f)]
        if theirs:  # the plan made first is run as the quantize is: never two values of one setting
            raise InputError(f"a plan made first by quantize runs with the quantize's own settings; give "
                             f"{', '.join(theirs)} in QuantizeOptions, not in its PlanOptions")
    return planned


# The PlanOptions fields a plan made first (``QuantizeOptions.plan``) takes from the quantize (``api._plan_first``),
# or that only ``plan_model`` writes or reads: given in the quantize's PlanOptions, refused.
QUANTIZE_RUNS_PLAN = ("method", "imatrix", "emit_tensor_types", "device", "trust_remote_code", "allow_pickle", "force",
                      "gptq_options")


def compile_choice(req: Request, ref: ModelRef, shapes: Mapping[str, tuple[int, ...]], config: dict,
                   planned: Plan | None) -> Choice:
    """The ``Choice`` for ``ref`` (its headers' ``shapes`` and ``config``): the rules' targets, or ``planned``'s
    types instead of them, then ``--tensor-type`` overrides; each refused in one line before any work
    (a glob that matches nothing, a plan for another model or measured another way, an importance matrix
    with no llama.cpp type to weight, a scheme the method cannot serve, calibration beyond the context)."""
    # A recipe (q4_k_m) needs facts of the model (layer count, tied embeddings): bound here, once.
    default = req.default.bind(config)
    if req.weighted and isinstance(default, Recipe):  # llama.cpp's choice reads has_imatrix (IQ4 recipes)
        default = default.with_imatrix(True)
    rules = Rules(req.rules.include, req.rules.exclude, tuple((g, s and s.bind(config)) for g, s in req.rules.overrides))
    rules.check_matches(shapes, ref.spec)  # a glob that matches no tensor: a typo, refused
    targets = {n: s for n, s in assign_schemes(shapes.items(), default, rules).items() if s is not None}
    if not targets:
        raise InputError(f"no tensor of {ref.spec} matches the quantization rules; check --include/--exclude")
    if planned is not None:
        check_plan_matches(planned, shapes, ref.spec)
        check_plan_method(planned, req.matrix, req.method, req.method_options)
        targets = {n: s for n, s in planned.schemes().items() if s is not None}
        default = get_scheme(base_type(planned)) if base_type(planned) != KEEP else default
    llama_names = llama_names_of(config, shapes)  # {} for a model llama.cpp does not name
    if req.overrides:
        if not llama_names:
            raise InputError(f"--tensor-type matches llama.cpp tensor names; {ref.spec} is not a llama/qwen2 model qkit names")
        targets = req.overrides.apply(targets, llama_names)
    targets, kept, head_notes = req.heads.apply(targets, shapes, config)  # llama.cpp's options before --tensor-type's
    if req.matrix is not None and not any(is_llama_type(s) for s in targets.values()):
        raise InputError(f"--imatrix weights llama.cpp's block types' searches; {default.name} is not one (use q2_k ... q8_0, "
                         "iq4_nl, iq4_xs or a llama.cpp recipe such as q4_k_m)")
    weights = quant_weights_for(req.matrix, config, shapes, targets) if req.matrix is not None else {}
    check_importance_reaches(targets, shapes, weights, isinstance(req.method, ImatrixMethod))
    if req.method is not None:
        # experts are calibrated on the tokens routed to them (gptq, imatrix); another method, refused
        check_method(config, req.method.name, req.method_options)
        for s in {s.name: s for s in targets.values()}.values():
            req.method.check(s)
        if req.method.calibrated:  # windows beyond the model's context, activations beyond memory: refused now
            check_fits(req.method_options.calibration_options(config), config)
    check_memory(req, ref, shapes, config, targets)  # the estimate above --max-memory (or what is free): refused
    manifest = new_manifest(default, rules)
    if req.overrides:
        manifest["rules"]["tensor_types"] = list(req.overrides.words)
    manifest["rules"].update(req.heads.record())
    if planned is not None:
        manifest["plan"] = planned.record()
    if req.matrix is not None:
        manifest["imatrix"] = imatrix_record(req.matrix, len(weights))
        if without := unweighted(targets, shapes, weights):  # token_embd, output: as llama-quantize writes them
            manifest["imatrix"]["unweighted"] = without
        if unreached := unreached_experts(req.matrix, config, list(targets)):  # weighted by 1s, as llama-quantize
            manifest["imatrix"]["unreached_experts"] = unreached
    notes = [*head_notes, *(imatrix_notes(req.matrix, ref.spec, shapes) if req.matrix is not None else [])]
    if virtual_experts(shapes, config):  # gpt_oss: no stored name per expert matrix for this format to write
        notes.append(f"{config.get('model_type')} stores its experts fused ([experts, in, out] tensors): they stay in "
                     "their source dtype in this format; --format gguf quantizes them")
    return Choice(default, rules, targets, llama_names, weights, planned, manifest, notes, kept,
                  shared_amax(ref, config, targets))


def check_importance_reaches(targets: Mapping[str, Scheme], shapes: Mapping[str, tuple[int, ...]],
                             weights: Mapping[str, torch.Tensor], collecting: bool) -> None:
    """Refuse, in one line, a tensor whose type llama.cpp quantizes only with an importance vector (iq2_xxs,
    iq2_xs: ``needs_importance``) that none will reach: no ``--imatrix`` entry, and not one ``--method imatrix``
    collects (``collecting``: every block projection; never ``token_embd`` / ``output``, as llama-imatrix)."""
    for name, scheme in targets.items():
        if not is_llama_type(scheme):  # only llama.cpp's types need one; another format refuses its own widths
            continue
        used = scheme.resolve(tuple(shapes[name]), name)
        if not needs_importance(used) or name in weights or (collecting and tensor_category(name) not in WHOLE_FILE):
            continue
        how = ("give it another type (--token-embedding-type, --output-tensor-type, --keep) or --exclude it"
               if collecting or weights else "give --imatrix FILE or --method imatrix, or choose iq2_s")
        raise InputError(f"{name} would be {used.name}, which llama.cpp quantizes only with an importance matrix "
                         f"(its quantizer asserts one), and no importance matrix entry reaches it; {how}")


def shared_amax(ref: ModelRef, config: dict, targets: Mapping[str, Scheme]) -> dict[str, torch.Tensor]:
    """Tensor -> the largest ``max |w|`` (fp32 scalar) of its fused group, for the targets whose scheme has a
    per-tensor scale a fused layer shares (``GroupScaled``: nvfp4's global scale). vLLM serves q/k/v as one
    ``qkv_proj`` and gate/up (each expert's too) as one ``gate_up_proj`` with ONE global scale (the linear
    schemes take the shards' largest, the MoE methods the gate's), so each shard is quantized with the group's:
    llm-compressor's ``update_fused_layer_weight_global_scales`` (the least of the shards' global scales,
    ``2688 / max amax``). Reads the grouped tensors once; a group holding NaN or inf is left alone (its tensor
    is refused when it is quantized)."""
    scaled = [n for n, s in targets.items() if isinstance(s, GroupScaled)]
    groups = fused_groups(scaled, fused_modules(config))
    if not groups:
        return {}
    read = tensor_reader(ref.directory, [n for members in groups.values() for n in members])
    out: dict[str, torch.Tensor] = {}
    for members in groups.values():
        amax = torch.stack([read(n).detach().abs().amax().float() for n in members]).max()
        if bool(torch.isfinite(amax)):
            out.update(dict.fromkeys(members, amax))
    return out


def imatrix_notes(matrix: Imatrix, spec: str, shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """A note when ``matrix``'s own record (qkit wrote it) says it was collected from another model: its
    tensors' fingerprint differs from this model's (or, in a record without one, its model is named
    otherwise). Its entries fit this model's names and widths (checked before), so it is a sibling, and
    its statistics are that model's activations, not these."""
    record = matrix.record or {}
    theirs = record.get("model_fingerprint")
    other = (theirs != shapes_fingerprint(shapes.items())) if isinstance(theirs, str) else (
        isinstance(record.get("model"), str) and record["model"] != spec)
    if not other:
        return []
    how = "a model with other tensors than" if isinstance(theirs, str) else "not"
    return [f"the importance matrix {matrix.source} was collected from {record.get('model')!s} (its record), {how} "
            f"{spec}: its statistics are that model's activations"]


def memory_need(req: Request, ref: ModelRef, shapes: Mapping[str, tuple[int, ...]], config: dict,
                targets: Mapping[str, Scheme] | None = None) -> Need:
    """What this quantize needs at its peak (``qkit.methods.memory``), from the headers and config: the
    process and the larger of the method's run (``Method.memory``) and the write (the quantized tensors, one
    tensor's quantize, a safetensors shard); rtn: the write alone. ``targets``: the chosen ones
    (``compile_choice``'s); None: the rules' with ``--tensor-type`` applied (before a plan is made)."""
    if targets is None:
        targets = {n: s for n, s in assign_schemes(shapes.items(), req.default.bind(config), req.rules).items() if s is not None}
        names = llama_names_of(config, shapes) if req.overrides else {}
        if names:
            targets = req.overrides.apply(targets, names)
    dtype = req.method_options.load_dtype if req.method is not None else torch.float32
    model = Model.of(shapes, tensor_dtypes(ref.directory), config, dtype)
    write = stream_parts(model, targets, get_format(req.format).holds_shard, req.max_shard_bytes)
    if req.method is None:
        return Need("this quantize", {"the process": BASELINE, **write})
    write = {"the quantized tensors": quantized_bytes(model, targets), **write}
    run = req.method.memory(model, targets, req.method_options)
    return Need(f"this quantize ({req.method.name})",
                {"the process": BASELINE, **(run if sum(run.values()) >= sum(write.values()) else write)})


def check_memory(req: Request, ref: ModelRef, shapes: Mapping[str, tuple[int, ...]], config: dict,
                 targets: Mapping[str, Scheme] | None = None) -> Need:
    """Refuse, in one line before any work, a quantize whose ``memory_need`` is above ``--max-memory`` (or,
    without it, above the memory available on the CPU; on CUDA only ``--max-memory`` is checked: the
    estimate is of host memory). Called last in ``compile_choice`` (the specific refusals first) and, before
    a plan is made (``--target-bits``), by ``api.quantize_model``. Returns the need."""
    need = memory_need(req, ref, shapes, config, targets)
    fp32 = req.method_options is not None and req.method_options.dtype == "fp32" and req.method.name in ("gptq", "imatrix")
    helps = "pass --dtype bf16, fewer --calibration-samples, or " if fp32 else ""
    if req.max_memory is not None or not str(req.device or "cpu").startswith("cuda"):
        check_need(need, req.max_memory, torch.device("cpu"), helps)
    return need


def check_plan_method(plan: Plan, matrix: Imatrix | None, method: Method | None,
                      method_options: CalibratedOptions | None = None) -> None:
    """A plan's costs were measured for one method's codes, with one matrix or none: its quantize must use
    the same (a ``gptq`` plan: ``--method gptq`` with the options its costs were measured with)."""
    planned_gptq = plan.method == "gptq"
    if planned_gptq and (method is None or method.name != "gptq"):
        name = method.name if method is not None else "rtn"
        other = f"re-plan with --method {name}" if name in PLAN_METHODS else f"{name} is not planned"
        raise InputError(f"the plan's costs were measured for gptq's codes; quantize it with --method gptq ({other})")
    if not planned_gptq and method is not None and not isinstance(method, ImatrixMethod):
        hint = "re-plan with --method gptq" if method.name == "gptq" else "quantize the plan with its own method (drop --method)"
        raise InputError(f"the plan's costs were measured with {plan.method}; {method.name} chooses other codes for the same "
                         f"types: {hint}")
    if planned_gptq:
        recorded = (plan.sensitivity.get("feedback") or {}).get("gptq") or {}
        # a plan priced before --hessian-shrink existed was priced with the reference's Hessian (0)
        measured = {"hessian_shrink": 0.0, **recorded} if recorded else {}
        given = {k: getattr(method_options, k, None) for k in measured}
        differ = [f"{k}={given[k]!r} (the plan: {v!r})" for k, v in sorted(measured.items()) if given[k] != v]
        if differ:
            raise InputError(f"the plan's costs were measured with GPTQ's {', '.join(f'{k}={v!r}' for k, v in sorted(measured.items()))}; "
                             f"this quantize gives {'; '.join(differ)}: use the plan's options or re-plan with them")
    uses_matrix = matrix is not None or (method is not None and not planned_gptq)
    if plan.imatrix is None and uses_matrix:
        raise InputError("the plan was measured without an importance matrix; re-plan with --imatrix/--method imatrix, "
                         "or quantize it without one")
    if plan.imatrix is not None and (method is None or planned_gptq):
        if matrix is None:
            raise InputError(f"the plan was measured with the importance matrix {plan.imatrix.get('file') or ''} "
                             f"(sha256 {str(plan.imatrix.get('sha256'))[:12]}...): pass it with --imatrix (or --method imatrix)")
        if matrix.sha256 != plan.imatrix.get("sha256"):
            raise InputError(f"--imatrix {matrix.source}: not the matrix the plan was measured with (sha256 "
                             f"{matrix.sha256[:12]}... against {str(plan.imatrix.get('sha256'))[:12]}...); re-plan with it")


def llama_names_of(config: dict, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
    """Hugging Face name -> llama.cpp's for every weight, or ``{}`` for a model llama.cpp does not name here."""
    try:
        return gguf_names(config, [n for n in shapes if n.endswith(".weight")])
    except QkitError:
        return {}


__all__ = ["Choice", "QuantizeOptions", "Request", "check_memory", "check_plan_method", "compile_choice", "llama_names_of",
           "memory_need", "request", "shared_amax"]
