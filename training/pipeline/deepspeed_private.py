"""Every name of DeepSpeed's internals that RetroPipe reaches, in this one module.

DeepSpeed's public API (deepspeed.initialize, deepspeed.pipe's PipelineModule / LayerSpec /
TiedLayerSpec, the engine's train_batch, eval_batch, save_checkpoint, load_checkpoint,
deepspeed.utils.safe_get_full_fp32_param) has no way to cut the stages at given boundaries, to
say which layers a stage holds, to broadcast tied weights again after a warm start, to add the
bf16 optimizer's gradients in one call, to link a resumed optimizer state to its parameters, or
to keep DeepSpeed from building a C++ op. For those, the functions below reach into DeepSpeed's
attributes and methods. deepspeed_engine.py, bf16_grads.py and elastic_state.py call these
functions; nothing else of RetroPipe touches a private name.

A DeepSpeed release may rename any of them without notice, so each is listed in PRIVATE_NAMES
(where it lives, what we use it for) and `check_private_names()` (run when a Pipeline is built,
and by tests/training/test_deepspeed_config.py) fails at once, naming what is gone, the installed
DeepSpeed and the range pyproject.toml pins, instead of training going wrong later. Before
widening that range, run the check (and the suite) against the new release.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import linecache
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from retropipe.training.run import TrainingError

_MODULE = "deepspeed.runtime.pipe.module.PipelineModule"
_ENGINE = "deepspeed.runtime.pipe.engine.PipelineEngine"
_GRID = "deepspeed.runtime.pipe.topology.PipelineParallelGrid"
_BF16 = "deepspeed.runtime.bf16_optimizer.BF16_Optimizer"
_ZERO = "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"


@dataclass(frozen=True)
class PrivateName:
    """`name` on `owner` (a dotted path: a module, a class, or an attribute of either).

    kind: "attr"  owner has it (a method, a module attribute);
          "sets"  an instance attribute: the code of owner (or of a DeepSpeed base class) assigns self.<name>;
          "reads" owner's code reads `.<name>` (an attribute of another object that we set or replace);
          "key"   owner is a mapping holding the key.
    """
    owner: str
    name: str
    kind: str
    why: str


PRIVATE_NAMES = (
    # -- cutting the pipeline at partition.py's boundaries (StagesCutAt) --
    PrivateName(_MODULE, "_partition_layers", "attr", "PipelineModule.__init__ calls it to pick this rank's layers; "
                "overridden to cut at partition.py's boundaries (DeepSpeed only offers named methods)"),
    PrivateName(_MODULE, "_topo", "sets", "the process topology: which stage this rank is"),
    PrivateName(_MODULE, "global_rank", "sets", "this rank, looked up in _topo"),
    PrivateName(_MODULE, "parts", "sets", "the stage boundaries, which the rest of PipelineModule reads"),
    PrivateName(_MODULE, "_set_bounds", "attr", "sets the slice of the layer list this rank builds"),
    # -- this stage's layers, by their names in the layer list (stage_layers, tied_modules) --
    PrivateName(_MODULE, "_local_start", "sets", "the index of this stage's first layer in the layer list"),
    PrivateName(_MODULE, "forward_funcs", "sets", "this stage's layers in order: modules, or a tied layer's "
                "later use as a function"),
    PrivateName(_MODULE, "tied_modules", "sets", "the tied modules (the token embedding) by key"),
    # -- tied weights (broadcast_tied_weights, tied_weights, no_gradient_for_frozen_tied_weights) --
    PrivateName(_MODULE, "_synchronize_tied_weights", "attr", "broadcasts the tied weights from their first stage: "
                "done again after a warm start has copied weights in"),
    PrivateName(_MODULE, "get_tied_weights_and_groups", "attr", "each tied weight with the group of stages "
                "holding a copy (the drift check, frozen tied weights)"),
    PrivateName(_ENGINE, "_hp_grad", "reads", "under bf16 the engine all-reduces a tied weight's fp32 gradient "
                "from weight._hp_grad: a frozen one is given None, the one-call add sets it"),
    # -- the bf16 optimizer's gradient accumulation (bf16_grads.py) --
    PrivateName(_ENGINE, "update_hp_grads", "reads", "the engine calls the bf16 optimizer's update_hp_grads after "
                "each micro-batch's backward: the call bf16_grads.py replaces"),
    PrivateName(_BF16, "update_hp_grads", "attr", "replaced by one foreach add (bf16_grads.py)"),
    PrivateName(_BF16, "immediate_grad_update", "sets", "whether gradients are added by per-parameter hooks instead"),
    PrivateName(_BF16, "bf16_groups", "sets", "the bf16 parameters, by group"),
    PrivateName(_BF16, "fp32_groups_gradients", "sets", "their fp32 gradients, which the add accumulates into"),
    PrivateName(_BF16, "fp32_groups_has_gradients", "sets", "which fp32 gradients hold a sum (marked by the add)"),
    # -- the torch optimizer inside DeepSpeed's (torch_optimizer) --
    PrivateName(_BF16, "optimizer", "sets", "the torch optimizer whose groups' settings a checkpoint load restores"),
    PrivateName(_ZERO, "optimizer", "sets", "the same inside the ZeRO-1 optimizer (fp32)"),
    # -- an elastic resume (link_optimizer_state; training/pipeline/elastic_state.py) --
    *(PrivateName(owner, "_lazy_init_hp_params_optimizer_state", "attr", "links AdamW's state, created after "
                  "the first step, to each parameter's fragment (safe_get/set_full_optimizer_state go through it)")
      for owner in (_BF16, _ZERO)),
    *(PrivateName(owner, "_hp_optimizer_states_linked", "sets", "whether that link was made: cleared to link "
                  "again (see link_optimizer_state)") for owner in (_BF16, _ZERO)),
    # -- this rank's place in the grid (parallel_ranks, pipe_group) --
    PrivateName(_ENGINE, "grid", "sets", "the pipeline/data-parallel grid of the engine"),
    *(PrivateName(_GRID, name, "attr", "this rank's place in the grid, and the group of its replica's stages")
      for name in ("get_data_parallel_rank", "get_data_parallel_world_size", "get_pipe_parallel_rank",
                   "get_pipe_parallel_world_size", "get_pipe_parallel_group")),
    # -- no C++ build of the shared-memory allreduce on CPU (skip_shm_comm_build) --
    PrivateName("deepspeed.ops", "__compatible_ops__", "attr", "the ops DeepSpeed may JIT-compile; deepspeed.comm "
                "reads it before building the shared-memory allreduce"),
    PrivateName("deepspeed.ops.__compatible_ops__", "deepspeed_shm_comm", "key", "the shared-memory allreduce for "
                "CPU (~90 s to build on first use), turned off: gloo does the same job"),
    PrivateName("deepspeed.comm.torch", "__compatible_ops__", "reads", "where the turned-off op is looked up"),
)


def _resolve(path: str):
    """The object at a dotted path (the longest importable module, then attributes); None if gone."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                return None
        return obj
    return None


@functools.lru_cache(maxsize=None)
def _source(obj) -> str:
    """The source of a module, or of a class and its DeepSpeed base classes."""
    if inspect.ismodule(obj):
        return inspect.getsource(obj)
    return "\n".join(_class_source(c) for c in inspect.getmro(obj) if c.__module__.startswith("deepspeed"))


def _class_source(cls) -> str:
    """A class's source, as inspect.getsource gives it, from its file parsed once: getsource
    tokenizes the file again for every class (2 s of each rank's start-up for these names)."""
    return _classes_in(inspect.getsourcefile(cls))[cls.__qualname__]


@functools.lru_cache(maxsize=None)
def _classes_in(path: str) -> dict[str, str]:
    """{qualified name: source} of every class defined in a Python file (its lines as inspect reads them)."""
    lines, found = linecache.getlines(path), {}

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                found.setdefault(prefix + child.name, "".join(lines[first - 1:child.end_lineno]))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{prefix}{child.name}.<locals>.")
    visit(ast.parse("".join(lines), path), "")
    return found


def _present(entry: PrivateName) -> bool:
    obj = _resolve(entry.owner)
    if obj is None:
        return False
    name = re.escape(entry.name)
    if entry.kind == "attr":
        return hasattr(obj, entry.name)
    if entry.kind == "key":
        return entry.name in obj
    if entry.kind == "sets":
        return re.search(rf"\bself\.{name}\s*(:[^=\n]*)?=(?!=)", _source(obj)) is not None
    if entry.kind == "reads":
        return re.search(rf"\.{name}\b", _source(obj)) is not None
    raise ValueError(f"PrivateName kind {entry.kind!r}")


def tested_range() -> str:
    """The deepspeed requirement pyproject.toml pins (from the checkout, else the installed metadata)."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if pyproject.is_file():
        found = re.search(r'"deepspeed\s*([^";]*)', pyproject.read_text())
        if found:
            return "deepspeed" + found.group(1).strip()
    try:
        from importlib.metadata import requires

        return next(r.split(";")[0].strip() for r in requires("retropipe") or () if r.startswith("deepspeed"))
    except Exception:  # noqa: BLE001 - not installed, or no deepspeed requirement: say where to look
        return "the deepspeed release pyproject.toml pins"


def check_private_names(names: tuple[PrivateName, ...] = PRIVATE_NAMES) -> None:
    """A TrainingError naming every entry of `names` the installed DeepSpeed lacks."""
    missing = [f"{e.owner}.{e.name}" if e.kind != "key" else f"{e.owner}[{e.name!r}]"
               for e in names if not _present(e)]
    if missing:
        import deepspeed

        raise TrainingError(f"DeepSpeed {deepspeed.__version__} lacks {', '.join(missing)} that "
                            f"training/pipeline/deepspeed_private.py reaches (its PRIVATE_NAMES say what for); "
                            f"RetroPipe is tested with {tested_range()} (pyproject.toml)")


# -- the functions the rest of RetroPipe calls --

def skip_shm_comm_build() -> None:
    """DeepSpeed JIT-compiles a shared-memory allreduce for CPU on first use (~90 s); gloo does the
    same job without a C++ build, so never build it."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class StagesCutAt:
    """Mixin before PipelineModule: its stages cut at explicit boundaries `parts` (DeepSpeed only
    offers named methods: "uniform", "parameters", "type:...")."""

    def __init__(self, layers, parts: list[int], **kwargs):
        self._retropipe_parts = list(parts)
        super().__init__(layers, **kwargs)

    def _partition_layers(self, method="uniform"):
        self.parts = list(self._retropipe_parts)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


def stage_layers(module, descs: list) -> list[tuple[str, object]]:
    """(name in the layer list, layer) of each layer of this rank's stage, in order: a module, or a
    function for a tied layer's later use (its module is in tied_modules)."""
    return [(descs[module._local_start + j].name, layer) for j, layer in enumerate(module.forward_funcs)]


def tied_modules(module) -> dict:
    """The tied modules this stage holds, by tie key."""
    return dict(module.tied_modules.items())


def broadcast_tied_weights(module) -> None:
    """Every stage's copy of a tied weight made its first stage's again (after a warm start)."""
    module._synchronize_tied_weights()


def tied_weights(module) -> list[tuple]:
    """(weight, process group of the stages holding a copy) for each tied weight of this stage."""
    return module.get_tied_weights_and_groups()


def no_gradient_for_frozen_tied_weights(module) -> None:
    """Every step the pipeline engine all-reduces each tied weight's gradient between the stages
    that hold it; under bf16 it reads the fp32 gradient `_hp_grad` that DeepSpeed's bf16 optimizer
    attaches to the parameters it trains. A frozen tied weight (the token embedding of a RETRO-fit)
    is not trained, so it has none: it is given None, which the engine skips, as it skips a None
    `.grad` in fp32."""
    for weight, _ in tied_weights(module):
        if not weight.requires_grad and not hasattr(weight, "_hp_grad"):
            weight._hp_grad = None


def parallel_ranks(engine) -> tuple[int, int, int]:
    """(data-parallel rank, data-parallel world size, pipeline stage) of this rank."""
    grid = engine.grid
    return grid.get_data_parallel_rank(), grid.get_data_parallel_world_size(), grid.get_pipe_parallel_rank()


def pipe_group(engine) -> tuple[int, object]:
    """(number of stages, the process group of this replica's stages)."""
    grid = engine.grid
    return grid.get_pipe_parallel_world_size(), grid.get_pipe_parallel_group()


def torch_optimizer(engine):
    """The torch optimizer inside DeepSpeed's ZeRO or bf16 optimizer (the engine's own without one)."""
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def link_optimizer_state(optimizer) -> None:
    """Link the torch optimizer's state to the parameters' fragments, as DeepSpeed's ZeRO-1 and bf16
    optimizers do after their first step. Linked again each time: ZeRO-1 links every group once,
    right after stepping the first group only, so the later groups' fragments (our no-decay group)
    stay linked to nothing."""
    if hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):  # none without ZeRO: nothing to link
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


# What the one-call add reads and writes on DeepSpeed's BF16_Optimizer (0.15 to 0.19).
_BF16_NEEDS = ("bf16_groups", "fp32_groups_gradients", "fp32_groups_has_gradients", "update_hp_grads")
# BF16_Optimizer settings under which its accumulation does more per parameter than add (CUDA
# graph harvesting, expert-parallel folding): read with a default, as older releases lack them.
_BF16_DOES_MORE = ("graph_harvesting", "autoep_folding_tp_group")


def bf16_optimizer_adding_after_backward(engine):
    """The engine's BF16_Optimizer where it adds each micro-batch's gradients after the backward
    (`immediate_grad_update` off) by plain adds; None where there is no bf16 optimizer or its hooks
    add them during the backward; None with a warning where it lacks what the one-call add uses
    or does more per parameter than add."""
    optimizer = engine.optimizer
    if getattr(optimizer, "immediate_grad_update", True):  # not BF16_Optimizer, or its hooks asked for
        return None
    missing = [name for name in _BF16_NEEDS if not hasattr(optimizer, name)]
    extra = [name for name in _BF16_DOES_MORE if getattr(optimizer, name, None)]
    if missing or extra:
        warnings.warn(f"bf16 gradients: DeepSpeed's own accumulation, one parameter at a time (its optimizer "
                      f"{'lacks ' + ', '.join(missing) if missing else 'uses ' + ', '.join(extra)})", stacklevel=3)
        return None
    return optimizer


def take_bf16_grads(optimizer) -> tuple[list, list]:
    """(fp32 gradients, the bf16 gradients to add into them) of every parameter with a gradient,
    each fp32 one marked as holding a sum and attached as the parameter's `_hp_grad` (what the
    pipe engine all-reduces for tied weights); the bf16 gradients are let go from the parameters,
    so the next backward writes its own instead of adding into them."""
    fp32, bf16 = [], []
    for i, group in enumerate(optimizer.bf16_groups):
        for j, param in enumerate(group):
            if param.grad is None:  # frozen, or on no path from this stage's loss
                continue
            hp_grad = optimizer.fp32_groups_gradients[i][j]
            fp32.append(hp_grad)
            bf16.append(param.grad.view(hp_grad.shape))
            param._hp_grad = hp_grad
            optimizer.fp32_groups_has_gradients[i][j] = True
            param.grad = None  # nothing reads it before the step; the next backward writes afresh
    return fp32, bf16


def replace_update_hp_grads(optimizer, update_hp_grads) -> None:
    """`update_hp_grads(clear_lp_grads=False)` called in place of the optimizer's own."""
    optimizer.update_hp_grads = update_hp_grads
