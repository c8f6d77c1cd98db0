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

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
APPS = os.path.join(ROOT, "apps")

# Lowest first. A module may import its own layer and the layers before it.
LAYERS = ("shared", "classifier", "serving", "inspection", "training", "commands")
SHARED = ("apps.cli", "apps.files")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _modules():
    """`{dotted name: path}` of every module under `apps/`."""
    found = {}
    for folder, _, names in os.walk(APPS):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return dict(sorted(found.items()))


MODULES = _modules()


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
    assert found == [
        "apps.classifier.model:2 (classifier) imports apps.training.train (training)"
    ]


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


@pytest.mark.parametrize("module", list(MODULES))
def test_module_is_at_most_500_lines(module):
    with open(MODULES[module], encoding="utf-8") as f:
        lines = sum(1 for _ in f)
    assert lines <= MAX_MODULE_LINES, f"{MODULES[module]}: {lines} lines"


def test_no_function_is_longer_than_a_screen():
    long = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} {lines}")
    assert long == []


# The library on two backends (issue #41): every module is written on `keras.ops`; what
# differs per backend is in `_backend/tensorflow.py` and `_backend/jax.py`, with the same names.
PACKAGE = os.path.join(ROOT, "keras_sdpa")
LIBRARY_MODULES = sorted(
    os.path.relpath(path, PACKAGE)[:-3]
    for path in glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True)
    if not path.endswith(os.path.join("_backend", "tensorflow.py"))
)
LAYER_PARTS = ("_arguments", "_cache", "_folded", "_layer_masks", "_rank_n")


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


def test_the_shims_of_both_backends_have_the_same_names_in_the_same_order():
    def functions(name):
        path = os.path.join(PACKAGE, "_backend", f"{name}.py")
        tree = ast.parse(open(path, encoding="utf-8").read())
        return [
            node.name for node in tree.body
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
        ]  # fmt: skip

    assert functions("tensorflow") == functions("jax")
    assert len(functions("jax")) >= 15


def test_no_library_module_is_over_about_700_lines():
    sizes = {
        m: len(open(os.path.join(PACKAGE, f"{m}.py")).read().splitlines())
        for m in LIBRARY_MODULES
    }
    assert max(sizes.values()) <= 760, sizes


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
    """The test files the JAX run repeats (`tests/test_jax_backend.py`) are written on
    `keras.ops` and NumPy: TensorFlow is imported only inside a TensorFlow-only test or
    branch, never at a module's top, where the JAX run would need it."""
    from test_jax_backend import BOTH_BACKENDS, LIBRARY

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
