"""The engine in one process without torch.distributed: names, views, parity, misuse errors."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn

import flatshard
from flatshard.engine.handle import HandleState, handle_of_param
from flatshard.engine.runtime import unit_states
from flatshard.testing.models import Block, TinyGPT, make_batch


def _pair(**kwargs: object) -> tuple[TinyGPT, TinyGPT]:
    torch.manual_seed(0)
    reference = TinyGPT()
    model = copy.deepcopy(reference)
    flatshard.shard(model, **kwargs)
    return reference, model


def test_names_parameter_objects_and_state_dict_keys_are_kept() -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    names_before = [n for n, _ in model.named_parameters()]
    params_before = list(model.parameters())
    keys_before = list(model.state_dict())
    flatshard.shard(model, auto_wrap_policy={Block})
    assert [n for n, _ in model.named_parameters()] == names_before
    assert all(a is b for a, b in zip(model.parameters(), params_before))
    assert list(model.state_dict()) == keys_before
    assert model.head.weight is model.wte.weight


def test_training_matches_reference_and_optimizer_built_before_shard() -> None:
    torch.manual_seed(0)
    reference = TinyGPT()
    model = copy.deepcopy(reference)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # built BEFORE shard()
    flatshard.shard(model, auto_wrap_policy={Block})
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        idx, tgt = make_batch(step, 4)
        for m, o in ((reference, ref_opt), (model, opt)):
            m.loss(idx, tgt).backward()
            o.step()
            o.zero_grad()
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=name)


def test_units_are_resharded_after_step_and_inference() -> None:
    _, model = _pair(auto_wrap_policy={Block})
    idx, tgt = make_batch(0, 2)
    model.loss(idx, tgt).backward()
    assert all(h.state is HandleState.SHARDED for s in unit_states(model) for h in s.handles)
    with torch.no_grad():
        model(idx)
    assert all(h.state is HandleState.SHARDED for s in unit_states(model) for h in s.handles)
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())


def test_inference_mode_then_training_still_works() -> None:
    reference, model = _pair(auto_wrap_policy={Block})
    idx, tgt = make_batch(0, 2)
    with torch.inference_mode():
        torch.testing.assert_close(model(idx), reference(idx))
    model.loss(idx, tgt).backward()
    reference.loss(idx, tgt).backward()
    torch.testing.assert_close(model.blocks[0].fc.weight.grad, reference.blocks[0].fc.weight.grad)


def test_frozen_parameters_inside_a_unit_get_no_gradient() -> None:
    torch.manual_seed(0)
    reference = TinyGPT()
    for m in (reference,):
        m.blocks[0].fc.weight.requires_grad_(False)
        m.wpe.weight.requires_grad_(False)
    model = copy.deepcopy(reference)
    flatshard.shard(model, auto_wrap_policy={Block})
    idx, tgt = make_batch(0, 2)
    model.loss(idx, tgt).backward()
    reference.loss(idx, tgt).backward()
    assert model.blocks[0].fc.weight.grad is None and model.wpe.weight.grad is None
    torch.testing.assert_close(model.blocks[0].fc.bias.grad, reference.blocks[0].fc.bias.grad)


def test_gradients_accumulate_across_backward_calls() -> None:
    reference, model = _pair(auto_wrap_policy={Block})
    for step in range(2):
        idx, tgt = make_batch(step, 2)
        model.loss(idx, tgt).backward()
        reference.loss(idx, tgt).backward()
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_sharding_twice_is_an_error() -> None:
    _, model = _pair()
    with pytest.raises(ValueError, match="already sharded"):
        flatshard.shard(model)


def test_tied_param_shared_outside_a_manually_sharded_unit_is_an_error() -> None:
    model = TinyGPT(tie=True)
    flatshard.shard(model.wte)
    with pytest.raises(ValueError, match="wte.weight|head.weight|outside it"):
        flatshard.shard(model)


def test_hybrid_sharding_without_a_process_group_is_an_error() -> None:
    with pytest.raises(ValueError, match="needs torch.distributed to be initialized"):
        flatshard.shard(TinyGPT(), sharding_strategy="HYBRID_SHARD")


def test_a_unit_of_several_dtypes_keeps_each_and_matches_the_plain_model() -> None:
    torch.manual_seed(0)
    reference = TinyGPT()
    reference.ln_f.double()
    model = copy.deepcopy(reference)
    flatshard.shard(model)
    state = unit_states(model)[0]
    assert sorted(str(h.dtype) for h in state.handles) == ["torch.float32", "torch.float64"]
    assert model.ln_f.weight.dtype == torch.float64 and model.wte.weight.dtype == torch.float32
    idx = torch.randint(0, 37, (2, 7))
    for m in (reference, model):
        m.ln_f.register_forward_pre_hook(lambda _m, args: (args[0].double(),))
        m.ln_f.register_forward_hook(lambda _m, _a, out: out.float())
        m.loss(idx, idx).backward()
    for (name, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
        assert q.grad is not None and q.grad.dtype == p.dtype, name
        torch.testing.assert_close(q.grad.reshape(p.shape), p.grad, msg=name)
    full, _ = flatshard.get_state_dict(model)
    assert full["ln_f.weight"].dtype == torch.float64 and full["wte.weight"].dtype == torch.float32


def test_state_dict_roundtrip_single_process() -> None:
    reference, model = _pair(auto_wrap_policy=700)
    full, _ = flatshard.get_state_dict(model)
    assert {k: v.shape for k, v in full.items()} == {k: v.shape for k, v in reference.state_dict().items()}
    other = TinyGPT()
    flatshard.shard(other, auto_wrap_policy={Block})
    flatshard.set_state_dict(other, None, full)
    idx, _ = make_batch(0, 2)
    with torch.no_grad():
        torch.testing.assert_close(other(idx), reference(idx))


def test_state_dict_of_another_width_names_the_first_shapes_and_counts_the_rest() -> None:
    model = TinyGPT()
    flatshard.shard(model, auto_wrap_policy={Block})
    wider = {k: torch.zeros([d + 1 for d in v.shape]) for k, v in TinyGPT().state_dict().items()}
    before = {k: v.clone() for k, v in flatshard.get_state_dict(model)[0].items()}
    with pytest.raises(
        ValueError, match=r"(?s)has shape .* more parameters of another shape \((\d+) in all\)"
    ) as err:
        flatshard.set_state_dict(model, None, wider)
    assert str(err.value).count("has shape") == 5 and "Nothing was loaded" in str(err.value)
    after = flatshard.get_state_dict(model)[0]
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_clip_grad_norm_matches_torch() -> None:
    reference, model = _pair(auto_wrap_policy={Block})
    idx, tgt = make_batch(0, 2)
    model.loss(idx, tgt).backward()
    reference.loss(idx, tgt).backward()
    for norm_type in (2.0, float("inf")):
        ours = flatshard.clip_grad_norm_(model, 0.01, norm_type)
        theirs = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01, norm_type)
        torch.testing.assert_close(ours, theirs)
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_buffer_dtype_alone_leaves_batch_norm_in_full_precision() -> None:
    """buffer_dtype without param_dtype: batch-norm statistics stay fp32 (their parameters are fp32), other
    buffers are cast for compute and return to their dtype in the state dict."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 6)
            self.bn = nn.BatchNorm1d(6)
            self.register_buffer("scale", torch.full((6,), 0.5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.lin(x)) * self.scale

    torch.manual_seed(0)
    reference = Net()
    model = flatshard.shard(copy.deepcopy(reference), mixed_precision={"buffer_dtype": "bf16"})
    x = torch.randn(8, 4)
    model(x).sum().backward()
    reference(x).sum().backward()
    assert model.bn.running_mean.dtype == torch.float32 and model.scale.dtype == torch.bfloat16
    torch.testing.assert_close(model.bn.running_var, reference.bn.running_var)
    state, _ = flatshard.get_state_dict(model)
    assert state["scale"].dtype == state["bn.running_mean"].dtype == torch.float32


def test_activation_checkpointing_never_checkpoints_the_sharded_module_itself() -> None:
    """A size policy matches the root (it holds every parameter): only modules below it are checkpointed."""
    from flatshard.engine.setup.activation_checkpointing import is_checkpointed

    torch.manual_seed(0)
    reference = TinyGPT()
    model = flatshard.shard(
        copy.deepcopy(reference), auto_wrap_policy={Block}, activation_checkpointing_policy=100
    )
    assert not is_checkpointed(model)
    assert any(is_checkpointed(m) for m in model.modules())
    idx, tgt = make_batch(0, 2)
    model.loss(idx, tgt).backward()
    reference.loss(idx, tgt).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


class _Skipping(TinyGPT):
    skip: frozenset[int] = frozenset()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for i, blk in enumerate(self.blocks):
            if i not in self.skip:
                h = blk(h)
        return self.head(self.ln_f(h))  # type: ignore[no-any-return]


def test_evaluation_forwards_leave_the_recorded_order_and_prefetch_alone() -> None:
    import warnings

    torch.manual_seed(0)
    model = flatshard.shard(_Skipping(), auto_wrap_policy={Block}, forward_prefetch=True)
    model.loss(*make_batch(0, 2)).backward()  # the training forward records the order
    order = unit_states(model)[0].ctx.order
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "order changed" warning
        model.skip = frozenset({1})
        with torch.no_grad():
            model(make_batch(1, 2)[0])  # an evaluation forward in another order
        model.generate(make_batch(2, 1)[0][:, :3], 3)  # and a decode loop
        model.skip = frozenset()
        model.loss(*make_batch(3, 2)).backward()
    assert order.recorded and order.valid
    assert all(h.state is HandleState.SHARDED for s in unit_states(model) for h in s.handles)


def test_a_saved_live_parameter_is_its_piece_and_no_units() -> None:
    """torch.save of a managed parameter writes its piece like any tensor's; loaded (also with weights_only)
    it is a plain parameter no unit manages, while the live one stays managed."""
    _, model = _pair(auto_wrap_policy={Block})
    param = model.wte.weight
    buffer = io.BytesIO()
    torch.save(param, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert torch.equal(loaded, param.detach()) and loaded.shape == param.shape
    assert handle_of_param(loaded) is None and handle_of_param(param) is not None
    assert handle_of_param(copy.deepcopy(param)) is None
