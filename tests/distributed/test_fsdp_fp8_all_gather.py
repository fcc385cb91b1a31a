"""FP8 weight all-gather for FSDP2 (`dist_quant.fsdp`), gloo, 2 ranks.

With FP8 all-gather every rank casts its weight shard to FP8 with the scale of the full weight, so
the gathered bytes are the bytes of casting the full weight, and the forward uses them as its
quantized weight: outputs, gradients (reduce-scattered in high precision) and the whole state dict
(weights, delayed-scaling scales and history) equal FSDP2 without FP8 all-gather, and DDP, bit for
bit, over several steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from fsdp_check import (
    FFN,
    HEADS,
    HIDDEN,
    RECIPES,
    Stack,
    assert_equal_runs,
    batch,
    local,
    shard,
    train_dp,
)
from harness import rank_device, run_ranks
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import dist_quant as dq
from dist_quant.fsdp import (
    FP8AllGatherWeight,
    enable_fp8_all_gather,
    fully_shard_model,
    precompute_fp8_weight_scales,
)

pytestmark = pytest.mark.distributed

STEPS = range(3)


def _sharded(fp8_all_gather: bool, checkpointed: bool = False, bf16: bool = False) -> Stack:
    model = Stack()
    model.checkpointed = checkpointed
    if fp8_all_gather:
        assert enable_fp8_all_gather(model) == 2 * 4  # per layer: qkv, proj, fc1, fc2
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    return shard(model, mp_policy=policy)


def _bf16_params(rank: int, world: int, recipes: list[str]) -> int:
    for recipe in recipes:
        runs = []
        for fp8_all_gather in (True, False):
            model = _sharded(fp8_all_gather, bf16=True)
            after = precompute_fp8_weight_scales if fp8_all_gather else None
            runs.append(
                train_dp(model, list(model.named_parameters()), recipe, rank, world, STEPS, after)
            )
        assert_equal_runs(runs[0], runs[1], f"BF16 parameters, {recipe}, rank {rank}")
    return len(recipes)


def test_fp8_all_gather_with_bf16_parameters_casts_the_bf16_shard():
    """Under FSDP2 mixed precision the high-precision path gathers BF16 weights and casts those;
    the FP8 path casts the BF16 shard, the same bytes."""
    assert run_ranks(_bf16_params, 2, ["delayed", "current"], timeout_s=240.0) == [2, 2]


def _equal_to_hp_gather(rank: int, world: int, runs: list[tuple[str, bool, bool]]) -> int:
    for recipe, precompute, checkpointed in runs:
        fp8 = _sharded(True, checkpointed)
        after = precompute_fp8_weight_scales if precompute else None
        got = train_dp(fp8, list(fp8.named_parameters()), recipe, rank, world, STEPS, after)
        hp = _sharded(False, checkpointed)
        want = train_dp(hp, list(hp.named_parameters()), recipe, rank, world, STEPS)
        assert_equal_runs(got, want, f"FP8 vs high-precision all-gather, {recipe}, rank {rank}")
        ddp = nn.parallel.DistributedDataParallel(Stack())
        plain = train_dp(ddp, list(ddp.module.named_parameters()), recipe, rank, world, STEPS)
        assert_equal_runs(got, plain, f"FP8 all-gather vs DDP, {recipe}, rank {rank}")
    return len(runs)


def test_fp8_all_gather_equals_high_precision_all_gather_and_ddp_bit_for_bit():
    runs = [
        ("delayed", False, False),
        ("current", True, False),
        ("current", False, False),
        ("custom", True, False),
    ]
    assert run_ranks(_equal_to_hp_gather, 2, runs, timeout_s=300.0) == [len(runs)] * 2


def test_fp8_all_gather_under_activation_checkpoint_equals_high_precision_all_gather():
    """The recompute in the backward uses the re-gathered bytes of the forward's scale and adds
    no amax to the history."""
    runs = [("delayed", False, True), ("current", True, True)]
    assert run_ranks(_equal_to_hp_gather, 2, runs, timeout_s=300.0) == [len(runs)] * 2


DEEP = 9  # one more block than dynamo's default recompile limit


def _deep(fp8_all_gather: bool, checkpointed: bool | str) -> Stack:
    """`DEEP` blocks; `checkpointed="around"`: each block wrapped by `checkpoint_wrapper` with
    `dq.activation_checkpoint` (torchtitan's order: a compiled block is the wrapper)."""
    model = Stack()
    torch.manual_seed(1)
    model.layers = nn.ModuleList(dq.TransformerLayer(HIDDEN, FFN, HEADS) for _ in range(DEEP))
    model.checkpointed = checkpointed is True
    if checkpointed == "around":
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer, checkpoint_fn=dq.activation_checkpoint)
    if fp8_all_gather:
        enable_fp8_all_gather(model)
    return shard(model)


def _compiled_equals_eager(rank: int, world: int, runs: list[tuple[str, bool | str]]) -> list[int]:
    """Every block `compile(fullgraph=True)`d on its own (`aot_eager`) over FP8-gathered weights,
    beside the eager model: outputs, gradients, weights and scaling state equal bit for bit; the
    number of graphs compiled per run."""
    graphs = []
    for recipe, checkpointed in runs:
        torch._dynamo.reset()
        count = [0]

        def counting(gm, example_inputs, count=count):
            count[0] += 1
            return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

        results = []
        for compiled in (True, False):
            model = _deep(True, checkpointed)
            if compiled:
                for layer in model.layers:
                    layer.compile(backend=counting, fullgraph=True)
            after = precompute_fp8_weight_scales if recipe == "current" else None
            params = list(model.named_parameters())
            results.append(train_dp(model, params, recipe, rank, world, STEPS, after))
        where = f"compiled vs eager, FP8 all-gather, {recipe}, AC={checkpointed}, rank {rank}"
        assert_equal_runs(results[0], results[1], where)
        graphs.append(count[0])
    return graphs


def test_blocks_compiled_with_fullgraph_over_fp8_gathered_weights_equal_eager_and_share_a_graph():
    """The gathered weight is a traceable tensor subclass: a compiled forward takes it as a
    tensor input and keeps its gradient (an opaque one used to lose it: the weights never
    trained). Identical blocks share one graph (two under activation checkpointing with delayed
    scaling: the recompute replays without enrolling)."""
    runs = [("delayed", False), ("current", False), ("delayed", True)]
    for rank_graphs in run_ranks(_compiled_equals_eager, 2, runs, timeout_s=600.0):
        assert rank_graphs == [1, 1, 2]


def test_blocks_compiled_around_their_checkpoint_over_fp8_gathered_weights_equal_eager():
    """torchtitan's order (checkpoint wrapper, then compile, then fully_shard), delayed scaling:
    the compiled backward recomputes the blocks without recasting (the casts are saved), exact
    and one graph for all blocks."""
    for rank_graphs in run_ranks(
        _compiled_equals_eager, 2, [("delayed", "around")], timeout_s=600.0
    ):
        assert rank_graphs == [1]


def _switch_follows(rank: int, world: int) -> int:
    """delayed -> current between steps: the all-gather follows the module's new recipe."""
    runs = []
    for fp8_all_gather in (True, False):
        model = _sharded(fp8_all_gather)
        params = list(model.named_parameters())
        out = train_dp(model, params, "delayed", rank, world, range(2))
        after = precompute_fp8_weight_scales if fp8_all_gather else None
        runs.append(out + train_dp(model, params, "current", rank, world, range(2, 4), after))
    assert_equal_runs(runs[0], runs[1], f"delayed -> current switch, rank {rank}")
    return 1


def test_fp8_all_gather_follows_a_switch_between_per_tensor_recipes():
    assert run_ranks(_switch_follows, 2, timeout_s=240.0) == [1, 1]


def _wrapped(model: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    return [
        (m, n, p)
        for m in model.modules()
        for n, p in m.named_parameters(recurse=False)
        if isinstance(p.to_local(), FP8AllGatherWeight)
    ]


class _CountGathers:
    """Bytes of the output of every all-gather FSDP2 starts (the outermost call only)."""

    def __init__(self) -> None:
        self.nbytes: list[int] = []
        self._depth = 0

    def __enter__(self):
        self._saved = {}
        for name in ("all_gather_single", "all_gather_into_tensor"):
            if hasattr(dist, name):
                self._saved[name] = fn = getattr(dist, name)
                setattr(dist, name, self._wrap(fn))
        return self

    def _wrap(self, fn):
        def counted(output, *args, **kwargs):
            if self._depth == 0:
                self.nbytes.append(output.numel() * output.element_size())
            self._depth += 1
            try:
                return fn(output, *args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _gathered_bytes(rank: int, world: int, recipe: str) -> int:
    moved = {}
    for fp8_all_gather in (False, True):
        model = _sharded(fp8_all_gather)
        dq.apply_recipe(model, RECIPES[recipe]())
        wrapped = {id(p) for _, _, p in _wrapped(model)}
        expected = [
            sum(
                p.numel() * (1 if id(p) in wrapped else p.element_size())
                for p in layer.parameters()
            )
            for layer in model.layers
        ]
        full_weights = {(id(m), n): p.full_tensor() for m, n, p in _wrapped(model)}
        seen = {}
        for m, n, _ in _wrapped(model):

            def capture(module, args, n=n, seen=seen):
                fp8 = getattr(module, n).float8_tensor()
                seen[(id(module), n)] = (fp8.data.view(torch.uint8).clone(), fp8.scale_inv)

            m.register_forward_pre_hook(capture)
        x = local(batch(0, world)[0], rank)
        with _CountGathers() as count, dq.autocast(amax_reduction_group=dist.group.WORLD):
            model(x)
        assert count.nbytes == expected, f"{recipe} fp8={fp8_all_gather}: {count.nbytes}"
        moved[fp8_all_gather] = sum(count.nbytes)
        assert seen.keys() == full_weights.keys()
        for key, (got, scale_inv) in seen.items():
            w = full_weights[key].float()
            if recipe == "delayed":  # the first step casts with the initial scale 1
                scale = torch.tensor(1.0)
            else:
                scale = torch.tensor(448.0) / w.abs().max()
            assert torch.equal(scale_inv, torch.ones(1) / scale)
            want = (w * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
            assert torch.equal(got, want), f"{recipe}: gathered bytes of {key} differ"
    weights = sum(p.numel() for _, _, p in _wrapped(model))
    assert moved[False] - moved[True] == 3 * weights  # 4 bytes -> 1 byte per weight element
    return len(seen)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_all_gather_moves_one_byte_per_weight_element_equal_to_casting_the_full_weight(recipe):
    assert run_ranks(_gathered_bytes, 2, recipe, timeout_s=120.0) == [8, 8]


class _CountAllReduces:
    def __init__(self) -> None:
        self.calls = 0

    def __enter__(self):
        self._saved = dist.all_reduce

        def counted(*args, **kwargs):
            self.calls += 1
            return self._saved(*args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._saved


def _precompute_batches(rank: int, world: int) -> tuple[int, int, int]:
    model = _sharded(True)
    dq.apply_recipe(model, RECIPES["current"]())
    x = local(batch(0, world)[0], rank)
    with _CountAllReduces() as unbatched, dq.autocast():
        model(x)
    with _CountAllReduces() as precompute:
        assert precompute_fp8_weight_scales(model) == 8
    with _CountAllReduces() as batched, dq.autocast():
        model(x)
    return unbatched.calls, precompute.calls, batched.calls


def test_precomputed_scales_take_one_all_reduce_for_every_weight():
    """Without precompute each weight's all-gather reduces its own amax; with it the scales of all
    eight weights come from one all-reduce and the forward reduces none."""
    assert run_ranks(_precompute_batches, 2, timeout_s=120.0) == [(8, 1, 0)] * 2


def _refusals(rank: int, world: int) -> list[str]:
    messages = []
    x = local(batch(0, world)[0], rank)
    for recipe in ("mxfp8", "block", "identity"):
        model = _sharded(True)
        with pytest.raises(dq.RecipeUpdateError, match="per-tensor") as err:
            dq.apply_recipe(model, RECIPES[recipe]())
        assert dq.current_recipe(model) is None  # nothing was published
        messages.append(str(err.value))
    # a lazy switch of an unpinned model, raised by the first all-gather that would need it
    with pytest.raises(dq.RecipeUpdateError, match="per-tensor") as err:
        with dq.autocast(recipe=RECIPES["mxfp8"](), amax_reduction_group=dist.group.WORLD):
            _sharded(True)(x)
    messages.append(str(err.value))
    model = _sharded(True)
    dq.apply_recipe(model, RECIPES["delayed"]())
    with pytest.raises(RuntimeError, match="amax_reduction_group"), dq.autocast():
        model(x)  # each rank's history would hold its shard's amax only
    with pytest.raises(RuntimeError, match="autocast"):
        _sharded(True)(x)
    return messages


def test_fp8_all_gather_refuses_recipes_and_settings_it_cannot_make_exact():
    for messages in run_ranks(_refusals, 2, timeout_s=120.0):
        assert all("layers.0" in m and ".weight'" in m for m in messages), messages
        assert "MXFP8BlockScaling" in messages[0] and "Float8BlockScaling" in messages[1]
        assert "CustomRecipe" in messages[2] and "MXFP8BlockScaling" in messages[3]


def _refused_switch(rank: int, world: int, how: str) -> int:
    """After FP8-gathered steps, a switch to a recipe the gather cannot serve raises before
    anything is published (`apply_recipe`) or gathered (a lazy `autocast(recipe=...)` of an
    unpinned model, running the default per-tensor recipe): the model trains on exactly as a
    twin that never tried."""
    runs = []
    for tries in (True, False):
        model = _sharded(True)
        params = list(model.named_parameters())
        out = train_dp(model, params, "delayed" if how == "apply_recipe" else None, rank, world,
                       range(2))  # fmt: skip
        if tries:
            with pytest.raises(dq.RecipeUpdateError, match="MXFP8BlockScaling"):
                if how == "apply_recipe":
                    dq.apply_recipe(model, RECIPES["mxfp8"]())
                else:
                    group = dist.group.WORLD
                    with dq.autocast(recipe=RECIPES["mxfp8"](), amax_reduction_group=group):
                        model(local(batch(2, world)[0], rank))
            assert type(dq.current_recipe(model)) is not dq.MXFP8BlockScaling
        runs.append(out + train_dp(model, params, None, rank, world, range(2, 4)))
    assert_equal_runs(runs[0], runs[1], f"refused switch ({how}), rank {rank}")
    plain = Stack()
    dq.apply_recipe(plain, RECIPES["mxfp8"]())
    with pytest.raises(ValueError, match=r"layers\.0\.self_attention.*per-tensor"):
        enable_fp8_all_gather(plain)
    assert not any(isinstance(p, FP8AllGatherWeight) for p in plain.parameters())
    return 1


@pytest.mark.parametrize("how", ["apply_recipe", "autocast"])
def test_a_switch_the_fp8_all_gather_cannot_serve_is_refused_and_leaves_training_as_it_was(how):
    assert run_ranks(_refused_switch, 2, how, timeout_s=240.0) == [1, 1]


def _default_on(rank: int, world: int) -> dict[str, bool]:
    chosen = {}
    for recipe in ("delayed", "current", "custom", "mxfp8", "identity"):
        model = Stack()
        dq.apply_recipe(model, RECIPES[recipe]())
        chosen[recipe] = fully_shard_model(model, model.layers)
        assert bool(_wrapped(model)) == chosen[recipe]
        after = precompute_fp8_weight_scales if chosen[recipe] else None
        train_dp(model, list(model.named_parameters()), None, rank, world, range(1), after)
    return chosen


def test_fully_shard_model_turns_fp8_all_gather_on_for_per_tensor_recipes_only():
    on = {"delayed": True, "current": True, "custom": True, "mxfp8": False, "identity": False}
    assert run_ranks(_default_on, 2, timeout_s=120.0) == [on, on]


def _cuda_equal(rank: int, world: int, recipes: list[str]) -> int:
    """One CUDA rank (NCCL): the Triton cast of the shard against the high-precision path."""
    device = rank_device()
    for recipe in recipes:
        runs = []
        for fp8_all_gather in (True, False):
            model = Stack().to(device)
            if fp8_all_gather:
                enable_fp8_all_gather(model)
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
            for layer in model.layers:
                fully_shard(layer, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
            dq.apply_recipe(model, RECIPES[recipe]())
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            out = []
            for step in STEPS:
                x, dy = (t.to(device) for t in batch(step, 1))
                with dq.autocast(amax_reduction_group=dist.group.WORLD):
                    y = model(x)
                y.backward(dy.to(y.dtype))
                grads = [p.grad.full_tensor().clone() for p in model.parameters()]
                opt.step()
                opt.zero_grad(set_to_none=True)
                if fp8_all_gather:
                    precompute_fp8_weight_scales(model)
                out.append((y.detach(), grads))
            runs.append(out)
        for step, (a, b) in enumerate(zip(*runs)):
            assert torch.equal(a[0], b[0]), f"{recipe} step {step}: y differs"
            assert all(torch.equal(u, v) for u, v in zip(a[1], b[1])), f"{recipe} {step}: grads"
    return len(recipes)


@pytest.mark.gpu
def test_fp8_all_gather_on_cuda_equals_the_high_precision_path():
    assert run_ranks(_cuda_equal, 1, ["delayed", "current"], timeout_s=240.0) == [2]


def _wrapped_and_compiled() -> Stack:
    """torchtitan's model: blocks wrapped for checkpointing, compiled, FSDP2, FP8 all-gather."""
    model = _deep(True, "around")
    for layer in model.layers:
        layer.compile(backend="aot_eager", fullgraph=True)
    return model


_BUILDS = {"plain": lambda: _sharded(True), "wrapped and compiled": _wrapped_and_compiled}


def _dcp_resume(rank: int, world: int, path: str, build: str) -> int:
    model = _BUILDS[build]()
    after = precompute_fp8_weight_scales
    train_dp(model, list(model.named_parameters()), "delayed", rank, world, range(2), after)
    dq.checkpoint.dcp_save(model, path)
    want = train_dp(model, list(model.named_parameters()), None, rank, world, range(2, 4), after)
    resumed = _BUILDS[build]()
    dq.apply_recipe(resumed, RECIPES["delayed"]())  # plans the roles the checkpoint holds
    dq.checkpoint.dcp_load(resumed, path)
    got = train_dp(resumed, list(resumed.named_parameters()), None, rank, world, range(2, 4), after)
    assert_equal_runs(got, want, f"resumed FSDP2 with FP8 all-gather ({build}), rank {rank}")
    return 1


@pytest.mark.parametrize("build", list(_BUILDS))
def test_fp8_all_gather_model_resumes_from_a_dcp_checkpoint_bit_for_bit(tmp_path, build):
    """Wrapped blocks too: their checkpoint keys are the model's own paths (the wrappers'
    attributes are not part of them), so a fresh model of the same build resumes."""
    assert run_ranks(_dcp_resume, 2, str(tmp_path / "ckpt"), build, timeout_s=600.0) == [1, 1]
