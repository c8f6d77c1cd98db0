"""The app's code in layers (issue #40): imports run one way, modules and functions stay short.

Each module of `apps/` is read with `ast` (nothing is imported), every import in it, those
inside functions too, is resolved to the module it names, and each one must point at a layer
at or below the importer's own:

    commands   apps/<command>.py shims, apps/math_verified.py, apps/generate.py
    training   apps/training/       the training run in its stages, run folders, seed sweeps
    inspection apps/inspection/     explain, faithfulness, the records, the page, the model card
    serving    apps/serving/        the SavedModel, the compiled classifier, the predictor
    classifier apps/classifier/     the data and the model (embedding, pooling, optimizer)
    shared     apps/cli.py, apps/files.py: anyone may import them; they import no other layer
"""

import ast
import glob
import os
import re
import subprocess
import sys
import typing

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
APPS = os.path.join(ROOT, "apps")

# Lowest first. A module may import its own layer and the layers before it.
LAYERS = ("shared", "classifier", "serving", "inspection", "training", "commands")
SHARED = ("apps.cli", "apps.files")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def modules_under(package):
    """`{dotted name: path}` of every module under the folder `package`."""
    found = {}
    for folder, _, names in os.walk(package):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return dict(sorted(found.items()))


MODULES = modules_under(APPS)


def layer_of(module):
    """The layer of a dotted module name under `apps`."""
    if module == "apps" or module in SHARED:
        return "shared"
    part = module.split(".")[1]
    return part if part in LAYERS else "commands"


def imports_of(module, path):
    """The `apps` modules that `module` imports, anywhere in its file (functions included),
    as `(line, imported module)`. `from . import x` names the module `x` where there is one."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:
                child = f"{target}.{alias.name}"
                found.append((node.lineno, child if child in MODULES else target))
    return [(line, name) for line, name in found if name == "apps" or name.startswith("apps.")]


def upward_imports(modules=MODULES):
    """`module:line imports name (layer above)` for each import that runs upward."""
    wrong = []
    for module, path in modules.items():
        rank = LAYERS.index(layer_of(module))
        for line, name in imports_of(module, path):
            if LAYERS.index(layer_of(name)) > rank:
                wrong.append(
                    f"{module}:{line} ({layer_of(module)}) imports {name} ({layer_of(name)})"
                )
    return wrong


def test_every_module_has_a_layer_and_the_layers_are_the_folders():
    layers = {layer_of(module) for module in MODULES}
    assert layers == set(LAYERS)
    for folder in ("classifier", "serving", "inspection", "training"):
        assert os.path.isfile(os.path.join(APPS, folder, "__init__.py")), folder


def test_imports_run_one_way():
    """No module imports a layer above its own: training over inspection and serving, over
    the classifier, over the shared file helpers."""
    assert upward_imports() == []


def test_the_check_sees_an_upward_import(tmp_path):
    """An import from the classifier up into training, written inside a function (as a lazy
    import would be), is found: the check reads the whole file."""
    path = tmp_path / "model.py"
    path.write_text("def f():\n    from ..training import train\n    return train\n")
    found = upward_imports({"apps.classifier.model": str(path)})
    assert found == ["apps.classifier.model:2 (classifier) imports apps.training.train (training)"]


def test_shared_modules_import_no_layer():
    for module in SHARED:
        assert imports_of(module, MODULES[module]) == [], module


def test_the_predictor_imports_neither_keras_nor_keras_sdpa():
    """`apps/serving/predict.py` serves the SavedModel with TensorFlow alone, and so do the
    `apps` modules it imports."""
    seen, todo = set(), ["apps.serving.predict"]
    while todo:
        module = todo.pop()
        if module in seen or module not in MODULES:
            continue
        seen.add(module)
        tree = ast.parse(open(MODULES[module], encoding="utf-8").read())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in ("keras", "keras_sdpa"), (module, name)
        todo += [name for _, name in imports_of(module, MODULES[module])]
        parent = module.rpartition(".")[0]
        todo.append(parent)  # a package's __init__ runs first
    assert "apps.classifier.buckets" in seen


# The library on two backends (issue #41): every module is written on `keras.ops`; what
# differs per backend is in `_backend/tensorflow.py` and `_backend/jax.py`, with the same names.
PACKAGE = os.path.join(ROOT, "keras_sdpa")
LIBRARY_MODULES = sorted(
    os.path.relpath(path, PACKAGE)[:-3]
    for path in glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True)
    if not path.endswith(os.path.join("_backend", "tensorflow.py"))
)
LAYER_PARTS = tuple(
    f"_layer/{name}"
    for name in ("arguments", "cache", "folded", "masks", "rank_n", "shapes", "stand_in")
)


def imported_modules(path):
    """Every module a file imports, at the top or inside a function, as dotted names."""
    names = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("module", LIBRARY_MODULES)
def test_no_module_but_the_tensorflow_shim_imports_tensorflow(module):
    names = imported_modules(os.path.join(PACKAGE, f"{module}.py"))
    assert not [name for name in names if name.split(".")[0] == "tensorflow"], module
    if module in LAYER_PARTS:  # data flows one way: the layer wires them, never the reverse
        layer = [n for n in names if n == "keras_sdpa.layer" or n.startswith("keras_sdpa.layer.")]
        assert layer == [], module


def test_the_shims_of_both_backends_define_the_contract_in_its_order():
    def functions(name):
        path = os.path.join(PACKAGE, "_backend", f"{name}.py")
        tree = ast.parse(open(path, encoding="utf-8").read())
        return [
            node.name
            for node in tree.body
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
        ]

    from keras_sdpa._backend import CONTRACT

    assert functions("tensorflow") == functions("jax") == [name for name, _ in CONTRACT]


def _outside_functions(tree):
    """Every node of a module that runs on import: inside `if` and `try` too, not inside a
    function's or a class's body."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def test_the_library_test_files_import_no_tensorflow_at_the_top():
    """The test files the JAX run repeats (`tests/backends/test_jax_backend.py`) are written on
    `keras.ops` and NumPy: TensorFlow is imported only inside a TensorFlow-only test or
    branch, never at a module's top, where the JAX run would need it."""
    from on_backend import BOTH_BACKENDS, LIBRARY

    files = [*LIBRARY, *BOTH_BACKENDS, "tests/on_backend.py"]
    on_top = {}
    for name in files:
        tree = ast.parse(open(os.path.join(ROOT, name), encoding="utf-8").read(), name)
        for node in _outside_functions(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            if any(module.split(".")[0] == "tensorflow" for module in modules):
                on_top.setdefault(name, []).append(node.lineno)
    assert on_top == {}
    assert len(files) >= 13


# The house (issues #55 and #62): `keras_sdpa/`, `apps/` and `benchmarks/` hold to 500 lines a
# module and 80 a function, measured on the code as `ruff format` lays it out (checked below);
# the docstring of a public function is counted apart.
HOUSE = {
    os.path.relpath(path, ROOT): path
    for folder in ("keras_sdpa", "apps", "benchmarks")
    for path in sorted(glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True))
}


def function_lengths(path):
    """`(line, qualified name, lines)` of every function in a file, nested ones included in
    their parent's lines; a public function's (or public class's method's) docstring is not
    counted."""
    found = []

    def visit(node, prefix, public):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = child.end_lineno - child.lineno + 1
                doc = child.body[0] if ast.get_docstring(child) else None
                if doc is not None and public and not child.name.startswith("_"):
                    lines -= doc.end_lineno - doc.lineno + 1
                found.append((child.lineno, prefix + child.name, lines))
                visit(child, f"{prefix}{child.name}.", False)
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.", public and not child.name.startswith("_"))
            else:
                visit(child, prefix, public)

    visit(ast.parse(open(path, encoding="utf-8").read(), path), "", True)
    return found


def long_functions(files):
    return [
        f"{name}:{line} {function} {lines}"
        for name, path in files.items()
        for line, function, lines in function_lengths(path)
        if lines > MAX_FUNCTION_LINES
    ]


@pytest.mark.parametrize("name", list(HOUSE))
def test_module_is_at_most_500_lines(name):
    with open(HOUSE[name], encoding="utf-8") as f:
        lines = sum(1 for _ in f)
    assert lines <= MAX_MODULE_LINES, f"{name}: {lines} lines"


def test_no_function_is_longer_than_a_screen():
    assert long_functions(HOUSE) == []


def _ruff(*args):
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True
    )


def test_the_formatter_lays_the_code_out():
    """`ruff format --check` and `ruff check` pass over the repository (pyproject.toml's
    settings): the layout is the formatter's, not packed by hand to meet the limits above."""
    formatted = _ruff("format", "--check", ".")
    assert formatted.returncode == 0, formatted.stdout + formatted.stderr
    checked = _ruff("check", ".")
    assert checked.returncode == 0, checked.stdout + checked.stderr


SKIP = re.compile(r"#\s*(fmt:\s*(skip|off)|yapf:\s*disable)")


def formatter_skips(paths):
    """`path:line` of each line that tells the formatter to leave it alone."""
    found = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            found += [f"{path}:{n}" for n, line in enumerate(f, 1) if SKIP.search(line)]
    return found


def test_the_formatter_is_not_told_to_skip(tmp_path):
    """No line of the repository's Python files keeps the formatter off (fmt skip or off,
    yapf disable): such a line would need its reason beside it, and none does."""
    folders = ("keras_sdpa", "apps", "benchmarks", "tests", "docs")
    paths = [
        path
        for folder in folders
        for path in sorted(glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True))
    ]
    assert formatter_skips(paths) == []
    packed = tmp_path / "packed.py"
    packed.write_text("x = 1\ny = [1,\n     2]  # " + "fmt: skip\n")
    assert formatter_skips([str(packed)]) == [f"{packed}:3"]


def test_the_check_counts_nested_functions_and_only_a_public_docstring_apart(tmp_path):
    """A public function's long docstring is not counted; a private one's is, and so is a
    nested function's body in its parent's."""
    doc = '    """' + "\n" * 90 + '    """\n'
    body = "    x = 1\n"
    nested = "        x = 1\n"
    path = tmp_path / "m.py"
    path.write_text(
        f"def public():\n{doc}{body}\n\ndef _private():\n{doc}{body}\n\n"
        f"def outer():\n    def inner():\n{nested * 90}\n    return inner\n"
    )
    assert [name.split(" ")[1] for name in long_functions({"m.py": str(path)})] == [
        "_private",
        "outer",
        "outer.inner",
    ]


def _library_trees():
    for name, path in HOUSE.items():
        if name.startswith("keras_sdpa"):
            yield name, ast.parse(open(path, encoding="utf-8").read(), path)


def _named(node):
    return node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)


def _decides(node, parent):
    """Whether `node` is read to decide something: compared (other than with None), tested
    (`if`, a conditional expression, `while`, `and`/`or`/`not`), or looked up by."""
    if isinstance(parent, ast.Compare):
        others = [parent.left, *parent.comparators]
        none_check = all(isinstance(op, (ast.Is, ast.IsNot)) for op in parent.ops) and any(
            isinstance(x, ast.Constant) and x.value is None for x in others
        )
        return not none_check
    if isinstance(parent, (ast.If, ast.IfExp, ast.While, ast.Assert)):
        return parent.test is node
    if isinstance(parent, ast.Subscript):
        return parent.slice is node
    if isinstance(parent, ast.Match):
        return True
    return isinstance(parent, ast.BoolOp) or (
        isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.Not)
    )


def path_choices_outside_the_plan(trees):
    """Every place outside `_core/plan.py` that reads `flash_attention` or `implementation` to
    decide something. Passing the value on (an argument, an attribute, a config entry) or
    asking whether it was given (`is None`) is not deciding, and neither is a `check_*`
    function of `_core/request.py` refusing a value that is none of the allowed ones."""
    found = []
    for name, tree in trees:
        if name.endswith("_core/plan.py"):
            continue
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        checks = {
            inner
            for node in ast.walk(tree)
            if name.endswith("_core/request.py")
            and isinstance(node, ast.FunctionDef)
            and node.name.startswith("check_")
            for inner in ast.walk(node)
        }
        for node in ast.walk(tree):
            if node in checks:
                continue
            if _named(node) in ("flash_attention", "implementation") and isinstance(
                getattr(node, "ctx", None), ast.Load
            ):
                if _decides(node, parents[node]):
                    found.append(f"{name}:{node.lineno} {_named(node)}")
    return found


def test_only_the_plan_decides_the_path():
    """`flash_attention` (the layer's), `implementation` (the core's) and a cached call's
    decode become one `Plan.path` in `keras_sdpa/_core/plan.py`, and nowhere else."""
    assert path_choices_outside_the_plan(_library_trees()) == []


def test_the_plan_check_sees_a_choice_made_elsewhere():
    """The old layer's `path` property and cached decode, written again, are found."""
    source = (
        "def path(self):\n"
        "    if self.flash_attention is None:\n"
        "        return self.implementation\n"
        "    return 'chunked' if self.flash_attention else 'dense'\n"
        "def cached(self, t):\n"
        "    return 'decode' if self.implementation == 'auto' and t == 1 else 'x'\n"
        "def given(flash_attention):\n"
        "    return f(flash_attention=flash_attention) if flash_attention is not None else 0\n"
        "def check_implementation(implementation):\n"
        "    if implementation not in ('auto', 'dense'):\n"
        "        raise ValueError(implementation)\n"
        "def checked_then_chosen(implementation):\n"
        "    return 'dense' if implementation == 'auto' else implementation\n"
    )
    trees = [
        (name, ast.parse(source)) for name in ("keras_sdpa/layer.py", "keras_sdpa/_core/request.py")
    ]
    found = sorted(
        path_choices_outside_the_plan(trees),
        key=lambda place: (place.split(":")[0], int(place.split(":")[1].split()[0])),
    )
    assert found == [
        "keras_sdpa/_core/request.py:4 flash_attention",
        "keras_sdpa/_core/request.py:6 implementation",
        "keras_sdpa/_core/request.py:13 implementation",
        "keras_sdpa/layer.py:4 flash_attention",
        "keras_sdpa/layer.py:6 implementation",
        "keras_sdpa/layer.py:10 implementation",  # a check, outside `_core/request.py`
        "keras_sdpa/layer.py:13 implementation",
    ]


def test_backends_are_told_apart_only_in_the_shims():
    """No `keras.backend.backend()` outside `keras_sdpa/_backend/`: what differs per backend
    is a shim function with the same name in both."""
    found = [
        f"{name}:{node.lineno}"
        for name, tree in _library_trees()
        if "_backend" not in name
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and ast.unparse(node.func).endswith(("backend.backend", "config.backend"))
    ]
    assert found == []


MUTABLE = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)


def module_state(trees):
    """`globals()` calls, `global` statements, and module-level dicts, lists and sets (literal
    or made by `dict()`, `defaultdict()`, ...) that a call could fill: tables are tuples or
    read-only mappings."""
    found = []
    for name, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Global) or (
                isinstance(node, ast.Call) and _named(node.func) == "globals"
            ):
                found.append(f"{name}:{node.lineno}")
        for node in tree.body:
            value = getattr(node, "value", None)
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or value is None:
                continue
            made = isinstance(value, ast.Call) and _named(value.func) in (
                "dict",
                "list",
                "set",
                "defaultdict",
                "OrderedDict",
                "WeakValueDictionary",
                "WeakKeyDictionary",
                "Counter",
            )
            target = _named(node.targets[0] if isinstance(node, ast.Assign) else node.target)
            if (isinstance(value, MUTABLE) or made) and target != "__all__":
                found.append(f"{name}:{node.lineno} {target}")
    return found


def test_the_core_keeps_no_module_state():
    """The compiled programs are keyed by their plan: no module of the library keeps a cache.
    (`_swap/scope.py` is apart: `sdpa_scope` patches names of the whole process, and counts its
    scopes there.)"""
    trees = [(name, tree) for name, tree in _library_trees() if not name.endswith("_swap/scope.py")]
    assert module_state(trees) == []
    old = "_TEMPLATES = {}\n_COMPILED: dict = dict()\ndef get(name):\n    globals()[name] = 1\n"
    assert module_state([("ops.py", ast.parse(old))]) == [
        "ops.py:4",
        "ops.py:1 _TEMPLATES",
        "ops.py:2 _COMPILED",
    ]


def benchmark_imports():
    """`{script: the benchmark modules it imports}`, at the top or inside a function."""
    names = {
        os.path.basename(path)[:-3] for name, path in HOUSE.items() if name.startswith("benchmarks")
    }
    graph = {}
    for name, path in HOUSE.items():
        if name.startswith("benchmarks"):
            graph[os.path.basename(path)[:-3]] = {
                module.split(".")[0] for module in imported_modules(path)
            } & names
    return graph


def test_benchmark_scripts_import_no_circle():
    """The scripts share `benchmarks/common.py` (the CPU name, timing, the results writer),
    and none imports one that imports it back."""
    graph = benchmark_imports()
    assert "common" in graph and graph["common"] == set()

    def reaches(start, target, seen=()):
        return any(
            module == target or (module not in seen and reaches(module, target, (*seen, module)))
            for module in graph.get(start, ())
        )

    assert [name for name in graph if reaches(name, name)] == []


def calls_back_into_the_layer(trees):
    """Calls from a module below the layer to one of the layer class's own private methods
    (`layer._compute_attention(...)`): data flows up, the layer calls down."""
    layer = ast.parse(open(os.path.join(PACKAGE, "layer.py"), encoding="utf-8").read())
    methods = {
        node.name
        for cls in layer.body
        if isinstance(cls, ast.ClassDef)
        for node in cls.body
        if isinstance(node, ast.FunctionDef)
        and node.name.startswith("_")
        and not node.name.startswith("__")
    }
    above = (
        "layer.py",
        "_layer/call.py",
        "swap.py",
        "_swap/scope.py",
        "_swap/references.py",
        "__init__.py",
    )
    return [
        f"{name}:{node.lineno} {ast.unparse(node.func)}"
        for name, tree in trees
        if not name.endswith(above)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in methods
        and ast.unparse(node.func.value) != "self"
    ]


def test_nothing_below_the_layer_calls_back_up_into_it():
    assert calls_back_into_the_layer(_library_trees()) == []
    old = ast.parse("def attend(layer, q):\n    return layer._compute_attention(q, q, q)\n")
    assert calls_back_into_the_layer([("keras_sdpa/_layer/folded.py", old)]) == [
        "keras_sdpa/_layer/folded.py:2 layer._compute_attention"
    ]


def test_the_records_have_no_field_typed_object():
    """The records a newcomer learns (`Request`, `Plan`, `CallTensors`, `Tensors`, the layer's
    `Call`, the chunked path's blocks, `Family`, `CallFamily`, the swap's report) type every
    field: none is `object` (`keras_sdpa/_shared/types.py` names the tensors and the mods)."""
    import dataclasses

    import keras_sdpa  # noqa: F401 (every module of the package)

    records = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("keras_sdpa"):
            continue
        for value in vars(module).values():
            if isinstance(value, type) and value.__module__ == name:
                if dataclasses.is_dataclass(value) or hasattr(value, "_fields"):
                    records.append(value)
    assert {f"{record.__module__}.{record.__qualname__}" for record in records} == {
        "keras_sdpa._core.chunked._Blocks",
        "keras_sdpa._core.request.Request",
        "keras_sdpa._core.plan.Template",
        "keras_sdpa._core.plan.Plan",
        "keras_sdpa._core.plan.CallTensors",
        "keras_sdpa._core.program.Tensors",
        "keras_sdpa._core.ring.Ring",
        "keras_sdpa._layer.call.Call",
        "keras_sdpa._swap.call_families.CallFamily",
        "keras_sdpa._swap.families.Family",
        "keras_sdpa.swap.AttentionReport",
    }

    def loose(annotation):  # `object` at any depth, or a bare `tuple` or `list`
        if annotation in (object, tuple, list):
            return True
        return any(loose(arg) for arg in typing.get_args(annotation) if arg is not Ellipsis)

    untyped = [
        f"{record.__module__}.{record.__qualname__}.{field}"
        for record in records
        for field, annotation in typing.get_type_hints(record).items()
        if loose(annotation)
    ]
    assert not untyped, untyped
