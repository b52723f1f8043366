"""Tests for actors/_registry.py: a factory path names a callable defined in an allowed module, nothing else."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from actors import DEFAULT_ALLOW, EXAMPLE_FACTORIES, NotAllowed, load_object
from examples import data, models
from tests.helpers import reexports

pytestmark = pytest.mark.timeout(60)

ALLOW = (*DEFAULT_ALLOW, *EXAMPLE_FACTORIES, "tests.helpers")


@pytest.mark.parametrize("path", ["examples.train_gpt:parse_args", "examples.train_gpt:main",
                                  "examples.train_gpt:plot_losses", "examples.train_hf:main",
                                  "examples.models:residual_mlp"])
def test_a_node_admits_no_example_unless_the_operator_does(path: str) -> None:
    # DEFAULT_ALLOW is what every node admits; the examples are the operator's choice (a LocalCluster's).
    with pytest.raises(NotAllowed, match="not on this node's allow-list"):
        load_object(path, DEFAULT_ALLOW)


@pytest.mark.parametrize("path", ["examples.train_gpt:parse_args", "examples.train_gpt:main",
                                  "examples.train_gpt:plot_losses", "examples.transport_demo:main"])
def test_the_example_scripts_are_never_factories(path: str) -> None:
    # What a LocalCluster admits for the demo: the factory modules, never the scripts (they parse
    # command lines, plot, write files and start clusters).
    with pytest.raises(NotAllowed, match="not on this node's allow-list"):
        load_object(path, (*DEFAULT_ALLOW, *EXAMPLE_FACTORIES))


@pytest.mark.parametrize(
    ("path", "match"),
    [
        # The probe's bypass: an attribute chain from an allowed module to os.system.
        ("torch.nn:functional.torch.os.system", r"reaches module torch\.nn\.functional through an attribute"),
        ("torch.nn.functional:torch.os.system", "reaches module torch through an attribute"),
        ("examples.models:torch.os.system", "reaches module torch through an attribute"),
        ("examples.models:F.torch.os.system", "reaches module torch.nn.functional"),
        ("tests.helpers.reexports:os.system", "reaches module os through an attribute"),
        ("tests.helpers.reexports:functools.partial", "reaches module functools"),
        ("torch.nn.functional:importlib.import_module", "reaches module importlib"),
        ("torch.nn.functional:np", "names module numpy, not a factory"),
        # Built-ins, named or re-exported.
        ("builtins:exec", "never holds factories"),
        ("builtins:eval", "never holds factories"),
        ("builtins:getattr", "never holds factories"),
        ("tests.helpers.reexports:evaluate", "the built-in eval re-exported"),
        ("tests.helpers.reexports:lookup", "the built-in getattr re-exported"),
        # Dunders and private names, anywhere in the path.
        ("torch.nn:functional.__builtins__", "names '__builtins__', a private or special name"),
        ("torch.nn:Module.__init__.__globals__", "names '__init__'"),
        ("torch.nn.functional:__import__", "names '__import__'"),
        ("builtins:__import__", "names '__import__'"),
        ("torch.nn:Module.__subclasses__", "names '__subclasses__'"),
        ("torch.nn:_reduction.legacy_get_string", "names '_reduction'"),
        ("torch.nn._reduction:legacy_get_string", "names '_reduction'"),
        ("__main__:linear_stack", "names '__main__'"),
        # Objects an allowed module only re-exports.
        ("tests.helpers.reexports:run", r"is posix\.system, defined outside this node's allow-list"),
        ("tests.helpers.reexports:system", r"is posix\.system"),
        ("tests.helpers.reexports:join", r"is posixpath\.join.*only re-exported by tests\.helpers\.reexports"),
        ("torch.nn.functional:conv2d", "defined outside this node's allow-list"),
        ("torch.nn.functional:Callable", r"is collections\.abc\.Callable"),
        ("tests.helpers.reexports:Builders.run", r"is posix\.system"),
        ("tests.helpers.reexports:Builders.shell", r"is posix\.system"),
        ("torch.nn.functional:Tensor.add", "class Tensor is defined in torch, which"),
        # Instances and descriptors are not factories.
        ("tests.helpers.reexports:shell", "names a partial object, not a function or class"),
        ("tests.helpers.reexports:instance", "names a Builders object"),
        ("tests.helpers.reexports:Builders.built", "names a property object"),
        ("tests.helpers.reexports:instance.stack", "instance is a Builders, not a class"),
        # Modules outside the allow-list are never imported.
        ("os:system", "start the node with --allow os"),
        ("subprocess:run", "start the node with --allow subprocess"),
        ("tests.not_admitted:linear_stack", "start the node with --allow tests.not_admitted"),
    ],
)
def test_paths_that_escape_the_allow_list_are_refused(path: str, match: str) -> None:
    with pytest.raises(NotAllowed, match=match):
        load_object(path, ALLOW)


def test_the_probe_bypass_is_refused_before_anything_is_called(tmp_path: Path) -> None:
    marker = tmp_path / "marker.txt"
    kwargs = {"command": f"touch {marker}"}
    with pytest.raises(NotAllowed):
        load_object("torch.nn:functional.torch.os.system", DEFAULT_ALLOW)  # what a node would call with kwargs
    assert kwargs and not marker.exists()


def test_a_module_outside_the_allow_list_is_not_imported() -> None:
    sys.modules.pop("tests.helpers.import_marker", None)
    with pytest.raises(NotAllowed, match="--allow tests.helpers.import_marker"):
        load_object("tests.helpers.import_marker:linear_stack", DEFAULT_ALLOW)
    assert "tests.helpers.import_marker" not in sys.modules


def test_a_class_reexported_from_an_unadmitted_module_is_refused() -> None:
    # Where torch.nn is admitted, nn.Linear reached through the helper module is fine;
    # where only the helper module is, it is someone else's class and refused.
    assert load_object("tests.helpers.reexports:Linear", ALLOW) is torch.nn.Linear
    with pytest.raises(NotAllowed, match=r"is torch\.nn\.modules\.linear\.Linear, defined outside"):
        load_object("tests.helpers.reexports:Linear", ("tests.helpers",))


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        # Every factory the repository names (tests, examples, benchmarks, docs).
        ("torch.nn:Linear", torch.nn.Linear),
        ("torch.nn.functional:mse_loss", torch.nn.functional.mse_loss),
        ("torch.nn.functional:cross_entropy", torch.nn.functional.cross_entropy),
        *((f"torch.optim:{name}", getattr(torch.optim, name)) for name in (
            "SGD", "Adam", "AdamW", "ASGD", "RMSprop", "RAdam", "NAdam", "Adamax", "Adagrad", "Adadelta")),
        ("examples.models:residual_mlp", models.residual_mlp),
        ("examples.models:gpt", models.gpt),
        ("examples.models:lm_loss", models.lm_loss),
        ("examples.data:regression_batches", data.regression_batches),
        ("examples.data:char_batches", data.char_batches),
        ("tests.helpers.models:stalling", None),
        ("tests.helpers.models:linear_stack", None),
        ("tests.helpers.models:guarded", None),
        ("tests.helpers.models:exploding", None),
        # Class.method paths: class-, static- and nested-class methods.
        ("tests.helpers.reexports:linear_stack", reexports.linear_stack),
        ("tests.helpers.reexports:Builders.stack", reexports.Builders.stack),
        ("tests.helpers.reexports:Builders.single", reexports.Builders.single),
        ("tests.helpers.reexports:Builders.Nested.stack", reexports.Builders.Nested.stack),
    ],
)
def test_factories_defined_in_allowed_modules_resolve(path: str, expected: object) -> None:
    obj = load_object(path, ALLOW)
    assert callable(obj)
    if expected is not None:
        assert obj == expected


def test_class_methods_resolve_bound_and_build() -> None:
    stack = load_object("tests.helpers.reexports:Builders.Nested.stack", ALLOW)
    assert len(stack()) == 3 and len(load_object("tests.helpers.reexports:Builders.stack", ALLOW)(layers=1)) == 1


@pytest.mark.parametrize(
    "path", ["import os; os.system('x')", "os.system", "torch.nn:", ":system", "a:b:c", "torch.nn:Linear()", 7]
)
def test_what_is_not_an_import_path_is_a_value_error(path: object) -> None:
    with pytest.raises(ValueError, match="not an import path"):
        load_object(path, ALLOW)  # type: ignore[arg-type]


def test_messages_carry_only_a_short_excerpt_of_the_path() -> None:
    path = "os:" + ".".join(["x"] * 10_000)
    with pytest.raises(NotAllowed) as info:
        load_object(path, ALLOW)
    assert len(info.value.message) < 400
    with pytest.raises(ValueError) as bad:
        load_object("!" * 100_000, ALLOW)
    assert len(str(bad.value)) < 400



@pytest.mark.parametrize(
    ("path", "error", "operator_sees"),
    [
        ("os:system", NotAllowed, "allow-list (torch.nn, torch.optim, examples.models, examples.data, examples.hf, tests.helpers)"),
        ("tests.helpers.reexports:run", NotAllowed, "allow-list (torch.nn, torch.optim, examples.models, examples.data, examples.hf, tests.helpers)"),
        ("torch.nn.functional:Tensor.add", NotAllowed, "allow-list (torch.nn, torch.optim, examples.models, examples.data, examples.hf, tests.helpers)"),
        ("tests.helpers.not_there:model", ModuleNotFoundError, "this process runs in"),
    ],
)
def test_a_clients_answer_names_the_rule_but_not_the_allow_list_nor_the_folder(
    path: str, error: type[Exception], operator_sees: str
) -> None:
    with pytest.raises(error) as operator:
        load_object(path, ALLOW)
    assert operator_sees in str(operator.value)
    with pytest.raises(error) as client:
        load_object(path, ALLOW, reveal=False)
    said = str(client.value)
    assert "allow-list (" not in said and "tests.helpers," not in said and "runs in" not in said
    assert "PYTHONPATH=" not in said and str(Path.cwd()) not in said
    # The same rule in the same words otherwise: the client still learns what to ask for.
    shown = str(operator.value).replace(f" ({', '.join(ALLOW)})", "")
    assert said == (shown if error is NotAllowed else shown.replace(shown[shown.index("this process"):
                                                                          shown.index("start it where")], ""))


@pytest.mark.parametrize(("path", "says"), [
    ("torch.optim:Adamm", "module 'torch.optim' has no attribute 'Adamm'; did you mean 'Adam'?"),
    ("torch.nn.functional:mse_los", "module 'torch.nn.functional' has no attribute 'mse_los'; did you mean 'mse_loss'?"),
    ("torch.optim:Adam.stepp", "'Adam' has no attribute 'stepp'; did you mean 'step'?"),
    ("torch.optim:zzzzqqq", "module 'torch.optim' has no attribute 'zzzzqqq'"),
    # Too short for a near spelling, but the start of a name (it said nothing).
    ("torch.nn.functional:mse", "module 'torch.nn.functional' has no attribute 'mse'; did you mean 'mse_loss'?"),
    ("torch.nn.functional:cross", "module 'torch.nn.functional' has no attribute 'cross'; did you mean "
                                  "'cross_entropy'?"),
])
def test_a_misspelt_factory_names_the_nearest_public_name(path: str, says: str) -> None:
    """A job's optimizer, loss or model misspelt said only "module 'torch.optim' has no attribute 'Adamm'"."""
    with pytest.raises(AttributeError) as info:
        load_object(path, ["torch"])
    assert str(info.value) == says


def test_a_local_clusters_allow_takes_one_prefix_as_a_string_and_refuses_what_is_not_a_name() -> None:
    from actors import LocalCluster

    # A string was taken letter by letter: allow="mypkg" admitted modules m, y, p, k and g, not mypkg.
    assert LocalCluster(nodes=1, allow="mypkg", examples=False).allow == ("mypkg",)
    assert LocalCluster(nodes=1, allow=["a.b", "c"], examples=False).allow == ("a.b", "c")
    assert LocalCluster(nodes=1, allow="mypkg").allow == (*EXAMPLE_FACTORIES, "mypkg")
    assert LocalCluster(nodes=1, preload="transformers").preload == ("transformers",)
    with pytest.raises(TypeError, match="allow takes module names .* got 3"):
        LocalCluster(nodes=1, allow=["mypkg", 3])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="preload takes module names .* got ''"):
        LocalCluster(nodes=1, preload=[""])


def test_a_huge_untrusted_path_is_quoted_without_copying_it() -> None:
    """Found by review: a client's 1 GiB check_import argument was repr'd whole (four bytes a byte) before
    the message cut it, so a client key could push a node towards the memory killer."""
    import tracemalloc

    from actors._errors import error_from_wire

    huge = b"\xff" * (16 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"is not an import path") as refused:
            load_object(huge, ())
        malformed = error_from_wire([huge])  # a malformed error reply quotes what it got
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(str(refused.value)) < 300 and len(malformed.message) < 300
    assert peak < len(huge) // 4  # a whole repr alone takes four times the bytes
