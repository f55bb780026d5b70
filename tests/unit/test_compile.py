"""torch.compile support without processes: the ``compile`` argument's checks, which units compile, which
forwards ``shard()`` seals, and one compiled model in one process counted frame by frame."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import flatshard
from flatshard.engine import compile_kwargs, compile_units
from flatshard.engine.calls.compile import leaf_units
from flatshard.engine.runtime import get_unit_state
from flatshard.testing.dynamo import watch_dynamo
from flatshard.testing.models import Block, TinyGPT, make_batch


def test_compile_kwargs_normalises_the_argument() -> None:
    assert compile_kwargs(False) is None and compile_kwargs(None) is None
    assert compile_kwargs(True) == {}
    kwargs = {"backend": "aot_eager", "fullgraph": True, "dynamic": None, "mode": None}
    assert compile_kwargs(kwargs) == kwargs and compile_kwargs(kwargs) is not kwargs


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (
            "max-autotune",
            TypeError,
            r"got str: 'max-autotune'. HINT: a mode goes in a dict: compile=\{'mode'",
        ),
        (1, TypeError, r"must be a bool or a dict of torch.compile keyword arguments, got int: 1. HINT"),
        (
            {"fullgrpah": True},
            ValueError,
            r"does not take: \['fullgrpah'\]. HINT: use fullgraph, dynamic, backend",
        ),
        ({"backend": 3}, TypeError, r"compile\['backend'\] must be a backend name or a callable.*HINT"),
        ({"fullgraph": "yes"}, TypeError, r"compile\['fullgraph'\] must be a bool"),
        ({"dynamic": "auto"}, TypeError, r"compile\['dynamic'\] must be True, False or None"),
        ({"mode": 1}, TypeError, r"compile\['mode'\] must be a string"),
        ({"options": [1]}, TypeError, r"compile\['options'\] must be a dict"),
        ({"mode": "default", "options": {}}, ValueError, r"both 'mode' and 'options'.*HINT"),
    ],
)
def test_compile_kwargs_refuses_bad_values_with_a_hint(value: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        compile_kwargs(value)


def test_fabric_strategy_checks_compile_too() -> None:
    with pytest.raises(TypeError, match="HINT: a mode goes in a dict"):
        flatshard.FlatShardFabricStrategy(compile="reduce-overhead")  # type: ignore[arg-type]
    assert flatshard.FlatShardFabricStrategy(compile={"backend": "eager"}).options.compile == {
        "backend": "eager"
    }


def _sharded(**kwargs: object) -> TinyGPT:
    torch.manual_seed(0)
    return flatshard.shard(TinyGPT(), **kwargs)  # type: ignore[return-value]


def test_leaf_units_and_sealed_forwards() -> None:
    model = _sharded(auto_wrap_policy={Block})
    assert leaf_units(model) == list(model.blocks)
    # The root encloses units: its own frame runs eagerly under torch.compile, what it calls compiles.
    assert "forward" in model.__dict__ and model.forward.__self__ is model
    assert inspect.signature(model.forward) == inspect.signature(TinyGPT().forward)
    assert all("forward" not in blk.__dict__ for blk in model.blocks)  # the units themselves compile
    assert "forward" not in model.blocks.__dict__  # a ModuleList has no forward to seal
    single = _sharded()
    assert leaf_units(single) == [single] and "forward" not in single.__dict__


def test_a_copy_calls_its_own_hooks_and_forward() -> None:
    model = _sharded(auto_wrap_policy={Block})
    copied = copy.deepcopy(model)
    assert copied.forward.__self__ is copied
    for original, twin in zip(model.modules(), copied.modules()):
        hooks = [*twin._forward_pre_hooks.values(), *twin._forward_hooks.values()]
        assert all(h.__self__ is get_unit_state(twin) for h in hooks), type(twin).__name__
        assert len(hooks) == (2 if get_unit_state(original) is not None else 0)
    idx, _ = make_batch(0, 2)
    torch.testing.assert_close(copied(idx), model(idx))


def test_compile_units_errors_and_already_compiled_units() -> None:
    with pytest.raises(ValueError, match="is not one. HINT: shard the model first"):
        compile_units(TinyGPT(), {})
    with pytest.raises(ValueError, match="is the only unit.*HINT: set auto_wrap_policy"):
        compile_units(_sharded(), {}, root=False)
    model = _sharded(auto_wrap_policy={Block})
    model.blocks[0].compile(backend="eager")  # compiled by the user: kept
    compiled = compile_units(model, {"backend": "eager"})
    assert compiled == list(model.blocks[1:])
    assert compile_units(model, {"backend": "eager"}) == []


def test_one_process_compiles_each_block_once_without_graph_breaks() -> None:
    torch.manual_seed(0)
    reference = TinyGPT()
    model = copy.deepcopy(reference)
    flatshard.shard(model, auto_wrap_policy={Block})
    counter = CompileCounter()
    with watch_dynamo() as watch:
        compiled = torch.compile(model, backend=counter)  # the whole model: each block's forward compiles
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for step in range(3):
            idx, tgt = make_batch(step, 4)
            for m, o in ((reference, ref_opt), (compiled, opt)):
                torch.nn.functional.cross_entropy(m(idx).flatten(0, 1), tgt.flatten()).backward()
                o.step()
                o.zero_grad()
            watch.step()
    assert counter.frame_count == 1 and watch.graphs == [1, 1, 1]  # one Block graph, for all blocks and steps
    assert watch.breaks() == {} and watch.warnings() == []
    full, _ = flatshard.get_state_dict(model)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(full[key], value, atol=1e-6, rtol=1e-6)
