"""DeepSpeed's ``optimizer`` and ``scheduler`` blocks as the job's ``optimizer`` and ``lr_scheduler``.

A ``type`` means what it means to DeepSpeed (``Adam`` is AdamW unless ``adam_w_mode`` is
false; any other name is looked up in ``torch.optim`` / ``torch.optim.lr_scheduler``), and
``params`` are checked before anything is submitted: a torch class is built once on a
dummy parameter, so an unknown keyword or a value torch refuses is reported here, with
its key. DeepSpeed's own schedules are checked against the parameters DeepSpeed
documents (``deepspeed.runtime.lr_schedules``), and become ``stages.state.lr`` classes that
take the same names.
"""

from __future__ import annotations

import difflib
import inspect
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from schedulers.deepspeed.checks import AUTO, ConfigError, Translation, mapping, show
from stages.spec_checks import closure_refusal

__all__ = ["DEEPSPEED_SCHEDULERS", "OPTIMIZERS", "translate_optimizer", "translate_scheduler"]

# DeepSpeed's optimizer "type" names (case-insensitive) and the torch class each becomes.
# DeepSpeed builds Adam as AdamW unless adam_w_mode is false (see translate_optimizer);
# names it does not know itself it looks up in torch.optim, as here.
OPTIMIZERS = {
    "adam": "torch.optim:AdamW",
    "adamw": "torch.optim:AdamW",
    "sgd": "torch.optim:SGD",
    "adagrad": "torch.optim:Adagrad",
    "adamax": "torch.optim:Adamax",
    "adadelta": "torch.optim:Adadelta",
    "rmsprop": "torch.optim:RMSprop",
    "nadam": "torch.optim:NAdam",
    "radam": "torch.optim:RAdam",
    "asgd": "torch.optim:ASGD",
    "rprop": "torch.optim:Rprop",
    "adafactor": "torch.optim:Adafactor",
    # DeepSpeed imports these from mup (maximal update parametrization).
    "muadam": "mup:MuAdam",
    "muadamw": "mup:MuAdamW",
    "musgd": "mup:MuSGD",
}

_ALTERNATIVE = ("use \"type\": \"AdamW\", or name a class that implements it by import path "
                "(\"type\": \"package.module:Class\", in a module your nodes admit)")
# DeepSpeed optimizers with no torch equivalent: refused with why, never swapped silently.
_REFUSED_OPTIMIZERS = {
    "lamb": f"LAMB is DeepSpeed's fused CUDA kernel (FusedLamb) and torch has no LAMB optimizer; {_ALTERNATIVE}",
    "onebitadam": ("1-bit Adam compresses DeepSpeed's own gradient all-reduce after a warm-up and has no torch "
                   f"equivalent (here reduce_codec quantizes the data-parallel reduction instead); {_ALTERNATIVE}"),
    "onebitlamb": (f"1-bit LAMB compresses DeepSpeed's own gradient all-reduce and has no torch equivalent; "
                   f"{_ALTERNATIVE}"),
    "zerooneadam": (f"0/1 Adam compresses and skips DeepSpeed's own gradient all-reduce and has no torch equivalent; "
                    f"{_ALTERNATIVE}"),
    "lion": f"Lion is DeepSpeed's fused kernel (FusedLion) and torch has no Lion optimizer; {_ALTERNATIVE}",
    "muon": ("DeepSpeed's Muon is MuonWithAuxAdam: Muon for the parameters the model marks use_muon, Adam for the "
             "rest, and a job here has one optimizer for every parameter; use \"type\": \"AdamW\" (or "
             "\"torch.optim:Muon\" if every parameter is a matrix)"),
    "lbfgs": closure_refusal("torch.optim:LBFGS"),
}
# Adam with 8- or 4-bit moments as bitsandbytes and torchao name it: (DeepSpeed's type, optimizer_states).
_LOW_BIT = {"adam8bit": ("adam", "int8"), "adamw8bit": ("adamw", "int8"),
            "adam4bit": ("adam", "int4"), "adamw4bit": ("adamw", "int4")}
# Keys of DeepSpeed's Adam (FusedAdam, DeepSpeedCPUAdam) that torch's Adam and AdamW do not take.
_ADAM_KEYS = ("adam_w_mode", "torch_adam", "bias_correction", "set_grad_none", "fp32_optimizer_states")
# What the Hugging Face Trainer fills "auto" optimizer params with when given no arguments.
_TRAINER_DEFAULTS = {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}

# DeepSpeed's schedules: DeepSpeed's type -> (stages.state.lr class, {param: kind}, required params),
# the parameters as deepspeed.runtime.lr_schedules names them.
# WarmupLR's (and WarmupDecayLR's) rates may be one per parameter group, as DeepSpeed's _format_param takes them.
_WARMUP = {"warmup_min_lr": "numbers", "warmup_max_lr": "numbers", "warmup_num_steps": "warmup",
           "warmup_type": "warmup_type", "last_batch_iteration": "start"}
DEEPSPEED_SCHEDULERS: dict[str, tuple[str, dict[str, str], tuple[str, ...]]] = {
    "WarmupLR": ("stages.state.lr:WarmupLR", _WARMUP, ()),
    "WarmupDecayLR": ("stages.state.lr:WarmupDecayLR", {"total_num_steps": "steps", **_WARMUP}, ("total_num_steps",)),
    "WarmupCosineLR": ("stages.state.lr:WarmupCosineLR", {
        "total_num_steps": "steps", "warmup_min_ratio": "number", "warmup_num_steps": "warmup",
        "cos_min_ratio": "number", "warmup_type": "warmup_type", "last_batch_iteration": "start"},
        ("total_num_steps",)),
    "OneCycle": ("stages.state.lr:OneCycle", {
        "cycle_min_lr": "number", "cycle_max_lr": "number", "decay_lr_rate": "number",
        "cycle_first_step_size": "steps", "cycle_second_step_size": "steps_or_null",
        "cycle_first_stair_count": "int", "cycle_second_stair_count": "int_or_null", "decay_step_size": "int",
        "cycle_momentum": "bool", "cycle_min_mom": "number", "cycle_max_mom": "number", "decay_mom_rate": "number",
        "last_batch_iteration": "start"}, ("cycle_min_lr", "cycle_max_lr")),
}
_REFUSED_SCHEDULERS = {
    "LRRangeTest": ("a learning-rate range test is a tuning run that raises the rate until training diverges, and "
                    "it is not built here; to grow the rate use \"type\": \"LinearLR\" (torch.optim.lr_scheduler)"),
    "ReduceLROnPlateau": ("it steps on a validation metric, and the job steps its schedule once per optimizer step "
                          "without one; use a schedule of the step count (e.g. WarmupCosineLR)"),
}


def _typed_section(t: Translation, section: Mapping[str, Any], name: str,
                   examples: str) -> tuple[str, dict[str, Any]] | None:
    """A ``{type, params}`` block's type and params, or None after noting what is wrong with it in ``t``."""
    kind = section.get("type")
    try:
        params = mapping(section, "params", f"{name}.")
    except ConfigError as exc:
        t.problems.extend(exc.problems)
        return None
    if not isinstance(kind, str) or not kind:
        t.problem(f"{name}.type", f"expected a name such as {examples}, got {show(kind)}")
        return None
    return kind, params


def translate_optimizer(t: Translation, section: Mapping[str, Any]) -> None:
    """``optimizer: {type, params}`` as the job's ``optimizer``; problems and notices go to ``t``."""
    typed = _typed_section(t, section, "optimizer", "Adam, AdamW or SGD")
    if typed is None:
        return
    kind, params = typed
    if "max_grad_norm" in params:
        params.pop("max_grad_norm")
        t.problem("optimizer.params.max_grad_norm", (
            "DeepSpeed refuses it as an optimizer parameter too; clip with the top-level \"gradient_clipping\": "
            "<max norm> (the norm over every stage and replica)"))
    path = _optimizer_path(t, kind, params)
    if path is None:
        return
    _resolve_auto_params(t, params)
    if _check_torch_class(t, path, params, "optimizer.params.", _build_optimizer):
        t.set("optimizer", (path, params), "optimizer")


def _optimizer_path(t: Translation, kind: str, params: dict[str, Any]) -> str | None:
    """The class a DeepSpeed ``type`` means (DeepSpeed-only ``params`` are taken out of ``params``)."""
    name = kind.lower()
    if ":" in kind:
        return kind  # a full import path, e.g. "torch.optim:ASGD"
    if name in _REFUSED_OPTIMIZERS:
        t.problem("optimizer.type", f"{kind} is not available here: {_REFUSED_OPTIMIZERS[name]}")
        return None
    if name in ("adam", "adamw"):
        return _adam(t, name, params)
    if name in _LOW_BIT:  # bitsandbytes' and torchao's names: Adam with its moments in fewer bits
        base, states = _LOW_BIT[name]
        t.set("optimizer_states", states, "optimizer.type")
        return _adam(t, base, params)
    if name in OPTIMIZERS:
        path = OPTIMIZERS[name]
        if path.startswith("mup:"):
            t.notice("optimizer.type", f"{kind} is {path} (as DeepSpeed builds it): every node needs the mup "
                                       "package and must admit the mup module, and the model factory must call "
                                       "mup.set_base_shapes")
        return path
    known = sorted({p.rpartition(":")[2] for p in OPTIMIZERS.values()})
    near = difflib.get_close_matches(name, OPTIMIZERS, n=1)
    hint = f" (did you mean {OPTIMIZERS[near[0]].rpartition(':')[2]}?)" if near else ""
    t.problem("optimizer.type", f"unknown optimizer {kind!r}{hint}; expected one of Adam, {', '.join(known)} "
                                "or an import path 'package.module:Class'")
    return None


def _adam(t: Translation, name: str, params: dict[str, Any]) -> str | None:
    """DeepSpeed's Adam/AdamW: decoupled weight decay (AdamW) unless ``adam_w_mode`` is false for Adam."""
    given = {key: params.pop(key) for key in _ADAM_KEYS if key in params}
    for key in ("adam_w_mode", "torch_adam", "bias_correction", "set_grad_none"):
        if key in given and not isinstance(given[key], bool):
            t.problem(f"optimizer.params.{key}", f"expected true or false, got {show(given[key])}")
            return None
    if given.get("bias_correction") is False:
        t.problem("optimizer.params.bias_correction", (
            "false is not available: torch's Adam and AdamW always correct the moments' bias; leave it out"))
    if given.get("set_grad_none") is False:
        t.notice("optimizer.params.set_grad_none", "no effect here: each stage sets its gradients to None after a step")
    if given.get("fp32_optimizer_states") is False:  # DeepSpeed's CPU Adam then keeps the moments as the weights
        t.set("optimizer_states", "bf16", "optimizer.params.fp32_optimizer_states")
    # torch_adam: DeepSpeed's switch from its fused kernel to torch's, which is what runs here either way.
    # Its fused (and CPU) Adam decays nothing unless asked; torch's AdamW decays by 0.01 unless told.
    if not given.get("torch_adam"):
        params.setdefault("weight_decay", 0.0)
    if name == "adam" and given.get("adam_w_mode") is False:
        return "torch.optim:Adam"  # L2 weight decay added to the gradient, as DeepSpeed's adam_w_mode=false
    return "torch.optim:AdamW"


def _resolve_auto_params(t: Translation, params: dict[str, Any]) -> None:
    """``"auto"`` optimizer params: the Trainer's defaults, except the learning rate, which has none to trust."""
    for key, value in list(params.items()):
        if value != AUTO:
            continue
        if key in _TRAINER_DEFAULTS:
            params[key] = _TRAINER_DEFAULTS[key]
            t.notice(f"optimizer.params.{key}", f"\"auto\" is {show(params[key])}, the Hugging Face Trainer's "
                                                "default; give a value in the job file to choose another")
        else:
            params.pop(key)
            what = "the learning rate" if key == "lr" else "this value"
            t.problem(f"optimizer.params.{key}", (
                f"\"auto\" is filled from the Hugging Face Trainer's arguments, and there is no Trainer here: give "
                f"{what} as optimizer.params.{key} in the job file (--job) or as an argument"))


def translate_scheduler(t: Translation, section: Mapping[str, Any], *, lr: Any) -> None:
    """``scheduler: {type, params}`` as the job's ``lr_scheduler``; problems and notices go to ``t``.

    Args:
        lr: ``optimizer.params.lr`` as the config gives it (what an ``"auto"`` ``warmup_max_lr`` is).
    """
    typed = _typed_section(t, section, "scheduler", "WarmupLR or WarmupDecayLR")
    if typed is None:
        return
    kind, params = typed
    by_lower = {name.lower(): name for name in DEEPSPEED_SCHEDULERS}
    if kind.lower() in by_lower:
        _deepspeed_schedule(t, by_lower[kind.lower()], params, lr)
        return
    if kind in _REFUSED_SCHEDULERS:
        t.problem("scheduler.type", f"{kind} is not available here: {_REFUSED_SCHEDULERS[kind]}")
        return
    if ":" in kind:
        path = kind
    elif isinstance(getattr(torch.optim.lr_scheduler, kind, None), type):
        path = f"torch.optim.lr_scheduler:{kind}"  # DeepSpeed's fallback for names it does not know
    else:
        known = [*DEEPSPEED_SCHEDULERS, *(n for n in dir(torch.optim.lr_scheduler) if n.endswith("LR"))]
        near = difflib.get_close_matches(kind, known, n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        t.problem("scheduler.type", (f"unknown schedule {kind!r}{hint}; expected one of "
                                     f"{', '.join(DEEPSPEED_SCHEDULERS)}, a torch.optim.lr_scheduler class, or an "
                                     "import path 'package.module:Class'"))
        return
    if _check_torch_class(t, path, params, "scheduler.params.", _build_scheduler):
        t.set("lr_scheduler", (path, params), "scheduler")


def _deepspeed_schedule(t: Translation, kind: str, params: dict[str, Any], lr: Any) -> None:
    path, kinds, required = DEEPSPEED_SCHEDULERS[kind]
    prefix = "scheduler.params."
    ok = True
    for key in list(params):
        if key not in kinds:
            near = difflib.get_close_matches(key, kinds, n=1)
            hint = f"did you mean {prefix}{near[0]}?" if near else f"{kind} takes {', '.join(kinds)}"
            t.problem(prefix + key, f"not a parameter of DeepSpeed's {kind}; {hint}")
            ok = False
        elif params[key] == AUTO:
            ok = _resolve_auto_schedule(t, key, params, lr) and ok
        else:
            ok = _check_schedule_value(t, kind, key, kinds[key], params) and ok
    for key in required:
        if key not in params:
            t.problem(prefix + key, f"missing: DeepSpeed's {kind} needs it")
            ok = False
    for key in ("cycle_first_stair_count", "cycle_second_stair_count"):
        if params.get(key):  # DeepSpeed (0.16.5) stores them and never reads them: its rates move every step
            t.notice(prefix + key, f"dropped, so that the rates are DeepSpeed's: its {kind} takes the stair counts "
                                   "and moves the rate every step whatever they say")
            params.pop(key)
    if kind == "WarmupLR" and "warmup_max_lr" not in params:
        t.notice(prefix + "warmup_max_lr", "not given: the rate warms up to the optimizer's lr here; DeepSpeed's "
                                           "default is 0.001 whatever that lr (deepspeedai/DeepSpeed#7303): give "
                                           "warmup_max_lr to say which")
    if ok:
        t.set("lr_scheduler", (path, params), "scheduler")


def _resolve_auto_schedule(t: Translation, key: str, params: dict[str, Any], lr: Any) -> bool:
    """``"auto"`` as the Hugging Face integration fills it, where this config holds what it is filled from."""
    if key == "warmup_min_lr":
        params[key] = 0.0  # the integration's own constant, not a Trainer argument
        return True
    if key == "warmup_max_lr":
        if isinstance(lr, (int, float)) and not isinstance(lr, bool):
            params[key] = float(lr)  # the integration fills it with the learning rate
            return True
        if lr == AUTO:
            return False  # optimizer.params.lr's own problem says what resolves both
        t.problem(f"scheduler.params.{key}", (
            "\"auto\" is the optimizer's learning rate, and optimizer.params.lr gives none: give optimizer.params.lr "
            "or scheduler.params.warmup_max_lr (in the job file, --job, or as an argument)"))
        return False
    what = {"total_num_steps": "the number of optimizer steps the run will take",
            "warmup_num_steps": "the number of warm-up steps"}.get(key, "a value")
    t.problem(f"scheduler.params.{key}", (
        f"\"auto\" is filled from the Hugging Face Trainer's arguments, and there is no Trainer here: give {what} as "
        f"scheduler.params.{key} in the job file (--job) or as an argument"))
    return False


def _check_schedule_value(t: Translation, kind: str, key: str, expected: str, params: dict[str, Any]) -> bool:
    value = params[key]
    where = f"scheduler.params.{key}"
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected == "warmup_type":
        if value not in ("log", "linear"):
            t.notice(where, f"{show(value)} is not log or linear: DeepSpeed falls back to log, and so does this")
            params[key] = "log"
        return True
    if expected == "start":  # DeepSpeed resumes a schedule from it; here a checkpoint's load does
        if value != -1 or isinstance(value, bool):
            t.problem(where, f"{show(value)}: a schedule here starts at -1 (the default), and a resumed job takes "
                      "its schedule's position from the checkpoint it loads (resume_from_checkpoint, or job.load); "
                      "leave last_batch_iteration out")
            return False
        return True
    if expected == "bool":
        ok = isinstance(value, bool)
    elif expected == "number":
        ok = numeric and value >= 0
    elif expected == "numbers":  # one, or one per parameter group
        values = value if isinstance(value, list) and value else [value]
        ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in values)
    elif expected == "warmup":  # DeepSpeed takes max(2, it): 0 is the Hugging Face integration's "no warm-up"
        ok = numeric and isinstance(value, int) and value >= 0
    elif expected in ("int", "int_or_null"):
        ok = (value is None and expected == "int_or_null") or (numeric and isinstance(value, int))
    else:  # steps, steps_or_null: DeepSpeed needs a positive integer
        ok = (value is None and expected == "steps_or_null") or (numeric and isinstance(value, int) and value >= 1)
    if not ok:
        wanted = {"bool": "true or false", "number": "a number >= 0",
                  "numbers": "a number >= 0, or a list of one per parameter group", "int": "an integer",
                  "int_or_null": "an integer or null", "steps": "an integer >= 1", "warmup": "an integer >= 0",
                  "steps_or_null": "an integer >= 1 or null"}[expected]
        t.problem(where, f"expected {wanted} for DeepSpeed's {kind}, got {show(value)}")
    return ok


# -- torch classes, checked by building them once ------------------------------------------


def _build_optimizer(cls: type, params: dict[str, Any]) -> object:
    return cls([torch.nn.Parameter(torch.zeros(2, 2))], **params)


def _build_scheduler(cls: type, params: dict[str, Any]) -> object:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.1)
    return cls(optimizer, **params)


def _check_torch_class(t: Translation, path: str, params: dict[str, Any], prefix: str,
                       build: Any) -> bool:
    """For a class in ``torch.optim``: every key is one of its parameters, and it accepts the values.

    Other modules are the user's own: they are not imported here (the config reader runs
    no user code), and each stage reports a wrong argument when it builds the class.
    """
    module, _, name = path.partition(":")
    if module not in ("torch.optim", "torch.optim.lr_scheduler"):
        return True
    cls = getattr(torch.optim if module == "torch.optim" else torch.optim.lr_scheduler, name, None)
    if not isinstance(cls, type):
        t.problem(prefix.rstrip(".").rpartition(".")[0] + ".type", f"{module} has no class {name!r}")
        return False
    signature = inspect.signature(cls)
    accepted = list(signature.parameters)[1:]  # after params / optimizer
    if not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        unknown = [key for key in params if key not in accepted]
        for key in unknown:
            near = difflib.get_close_matches(key, accepted, n=1)
            hint = f"did you mean {prefix}{near[0]}?" if near else f"it takes {', '.join(accepted)}"
            t.problem(prefix + key, f"not a parameter of {path}; {hint}")
        if unknown:
            return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            build(cls, params)
    except (TypeError, ValueError, RuntimeError, KeyError) as exc:
        t.problem(prefix.rstrip("."), f"{path} refuses {show(params)}: {str(exc)[:200]}")
        return False
    return True
