"""The library's rooms (issue #77): `keras_sdpa/` in folders by concept, imports only downward.

The rooms, lowest first, and what each holds are drawn once, in docs/development.md ("The
library's rooms"); these tests read that drawing and every module of the library with `ast`
(nothing is imported), every import too, those inside functions included:

- each module is in the drawing, in the room whose folder holds it;
- a module imports only its own room and the rooms below it (a public face belongs to its
  room: `ops.py` to `_core/`);
- no path of the core imports another path (`decode` takes nothing from `dense`: what two paths
  share lives in `softmax`, `layout` or `mod_calls`);
- no `module._name` of another room is read: what a room offers the rooms above has a public
  name inside the private package.
"""

import ast
import inspect
import os
import re

from test_house import modules_under

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "keras_sdpa")
DRAWING = os.path.join(ROOT, "docs", "development.md")

# The public faces, each in the room whose work it shows; `keras_sdpa/__init__.py` is above all.
FACES = {
    "keras_sdpa.mods": "_mods",
    "keras_sdpa.ops": "_core",
    "keras_sdpa.layer": "_layer",
    "keras_sdpa.swap": "_swap",
    "keras_sdpa": "package",
}
CORE_PATHS = tuple(f"keras_sdpa._core.{path}" for path in ("dense", "chunked", "decode", "ring"))


def drawing():
    """`(rooms lowest first, {room: the module files the drawing lists in it}, {public face:
    its room})`."""
    text = open(DRAWING, encoding="utf-8").read()
    section = text.split("### The library's rooms", 1)[1].split("###", 1)[0]
    rooms, files, faces = [], {}, {}
    for line in section.splitlines():
        room = re.match(r"    keras_sdpa/(_\w+)/ ", line)
        if room:
            rooms.append(room.group(1))
            files[room.group(1)] = set()
        module = re.match(r"        (\w+\.py) ", line)
        if module and rooms:
            files[rooms[-1]].add(module.group(1))
        face = re.match(r"        \.\./(\w+)\.py ", line)
        if face and rooms:
            faces[f"keras_sdpa.{face.group(1)}"] = rooms[-1]
    return (*rooms, "package"), files, faces


ROOMS, DRAWN, DRAWN_FACES = drawing()


MODULES = modules_under(PACKAGE)


def room_of(module):
    if module in FACES:
        return FACES[module]
    return module.split(".")[1]


def resolve(name, modules):
    """The library module that a dotted import names (`keras_sdpa._core.blocks.Blocking` is
    `keras_sdpa._core.blocks`), or None outside the library."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(tree, modules, module=None):
    """`(line, module, {alias: module})` for each import of a library module in `tree`;
    relative imports are resolved from `module` (the importer's dotted name)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = resolve(alias.name, modules)
                if target:
                    # `import keras_sdpa._core.plan` binds `keras_sdpa`: reads go through it
                    name = alias.asname or alias.name.split(".")[0]
                    bound = target if alias.asname else resolve(name, modules)
                    found.append((node.lineno, target, {name: bound}))
        elif isinstance(node, ast.ImportFrom) and (node.module or node.level):
            base = node.module or ""
            if node.level:
                package = module.split(".")
                is_package = modules.get(module, "").endswith("__init__.py")
                package = package[: len(package) - node.level + is_package]
                base = ".".join(package + ([node.module] if node.module else []))
            for alias in node.names:
                target = resolve(f"{base}.{alias.name}", modules)
                if target:
                    found.append((node.lineno, target, {alias.asname or alias.name: target}))
    return found


def dotted(node):
    """`a.b.c` of an attribute chain on a name, or None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def trees(modules=MODULES):
    return {
        name: ast.parse(open(path, encoding="utf-8").read(), path) for name, path in modules.items()
    }


def wrong_imports(parsed, modules=MODULES):
    """`module:line imports name (why)` for each upward import and each path-to-path import."""
    wrong = []
    for module, tree in parsed.items():
        rank = ROOMS.index(room_of(module))
        for line, target, _ in imports_of(tree, modules, module):
            if ROOMS.index(room_of(target)) > rank:
                why = f"{room_of(module)} below {room_of(target)}"
                wrong.append(f"{module}:{line} imports {target} ({why})")
            elif module in CORE_PATHS and target in CORE_PATHS and target != module:
                wrong.append(f"{module}:{line} imports {target} (one path from another)")
    return wrong


def private_reads(parsed, modules=MODULES):
    """`module:line reads other._name` for each private name of another room's module that a
    module imports or reads as an attribute (through any chain: `pkg.room.module._name`)."""
    found = []
    for module, tree in parsed.items():
        aliases = {}
        for *_, named in imports_of(tree, modules, module):
            aliases.update(named)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                if room_of(node.module) == room_of(module):
                    continue
                for alias in node.names:
                    if alias.name.startswith("_") and f"{node.module}.{alias.name}" not in modules:
                        found.append(f"{module}:{node.lineno} reads {node.module}.{alias.name}")
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
                chain = dotted(node.value)
                if node.attr.startswith("__") or chain is None:
                    continue
                head, _, rest = chain.partition(".")
                if head not in aliases:
                    continue
                owner = resolve(".".join(filter(None, [aliases[head], rest])), modules)
                if f"{owner}.{node.attr}" in modules:
                    continue  # a private module (`keras_sdpa._core`), not a private name
                if owner and room_of(owner) != room_of(module):
                    found.append(f"{module}:{node.lineno} reads {owner}.{node.attr}")
    return found


def test_every_module_is_in_the_drawing_in_its_room():
    """The drawing lists each module of each room's folder, and nothing else (a room's
    `__init__.py` holds only its docstring, but `_backend`'s, which is drawn)."""
    for room in ROOMS[:-1]:
        folder = os.path.join(PACKAGE, room)
        on_disk = {name for name in os.listdir(folder) if name.endswith(".py")}
        assert DRAWN[room] | {"__init__.py"} == on_disk, room
    top = {name for name in os.listdir(PACKAGE) if name.endswith(".py")}
    assert top == {"__init__.py", "ops.py", "mods.py", "layer.py", "swap.py"}
    assert set(ROOMS) == {*FACES.values(), "_backend", "_shared"}
    assert DRAWN_FACES == {name: room for name, room in FACES.items() if name != "keras_sdpa"}


def test_imports_run_down_the_rooms():
    assert ROOMS == ("_backend", "_shared", "_mods", "_core", "_layer", "_swap", "package")
    assert wrong_imports(trees()) == []


def test_the_check_sees_an_upward_and_a_sibling_import():
    """Planted in today's modules: the plan importing the layer, the decode path the dense
    one's helper (as it once did), inside a function as a lazy import would be."""
    parsed = trees()
    parsed["keras_sdpa._core.plan"].body.append(
        ast.parse("def f():\n    from keras_sdpa import layer\n    return layer\n").body[0]
    )
    parsed["keras_sdpa._core.decode"].body.insert(
        0, ast.parse("from keras_sdpa._core import dense")
    )
    parsed["keras_sdpa._core.ring"].body.insert(0, ast.parse("from . import chunked"))
    parsed["keras_sdpa._core.blocks"].body.insert(0, ast.parse("from .. import swap"))
    found = wrong_imports(parsed)
    assert len(found) == 4, found
    assert any("_core.ring:1 imports keras_sdpa._core.chunked (one path" in f for f in found)
    assert any("_core.blocks:1 imports keras_sdpa.swap (_core below _swap)" in f for f in found)
    found = [f for f in found if "ring" not in f and "blocks" not in f]
    assert found[0].startswith("keras_sdpa._core.decode:1 imports keras_sdpa._core.dense (one path")
    assert "keras_sdpa._core.plan" in found[1] and "(_core below _layer)" in found[1]


def test_no_private_name_crosses_a_room():
    assert private_reads(trees()) == []


def test_the_check_sees_a_private_name_read_from_another_room():
    parsed = trees()
    planted = "from keras_sdpa._core import plan as p\nfrom keras_sdpa._core.plan import _path\n"
    planted += "def f():\n    return p._implementation\n"
    parsed["keras_sdpa._layer.cache"].body.extend(ast.parse(planted).body)
    found = private_reads(parsed)
    assert [line.split(" reads ")[1] for line in found] == [
        "keras_sdpa._core.plan._path",
        "keras_sdpa._core.plan._implementation",
    ]
    chained = "import keras_sdpa._core.plan\nfrom keras_sdpa import _core\n"
    chained += "a = keras_sdpa._core.plan._path\nb = _core.plan._implementation\n"
    parsed = trees()
    parsed["keras_sdpa._layer.cache"].body.extend(ast.parse(chained).body)
    found = private_reads(parsed)
    assert [line.split(" reads ")[1] for line in found] == [
        "keras_sdpa._core.plan._path",
        "keras_sdpa._core.plan._implementation",
    ]
    same_room = "from keras_sdpa._core import plan as p\nx = p._implementation\n"
    parsed = trees()
    parsed["keras_sdpa._core.program"].body.extend(ast.parse(same_room).body)
    assert private_reads(parsed) == []


def unannotated(functions):
    """`function(parameter)` for each parameter without a type, and `function -> ?` for a
    missing return type (a constructor returns None)."""
    missing = []
    for function in functions:
        signature = inspect.signature(function)
        for name, parameter in signature.parameters.items():
            if name != "self" and parameter.annotation is inspect.Parameter.empty:
                if parameter.kind is not inspect.Parameter.VAR_KEYWORD:
                    missing.append(f"{function.__qualname__}({name})")
        if function.__name__ != "__init__" and signature.return_annotation is signature.empty:
            missing.append(f"{function.__qualname__} -> ?")
    return missing


def test_every_public_signature_is_typed():
    """The public functions, the layer's constructor and call, and the mods' factories."""
    import keras_sdpa
    from keras_sdpa import mods

    public = [getattr(keras_sdpa, name) for name in keras_sdpa.__all__]
    functions = [f for f in public if inspect.isfunction(f)]
    functions += [keras_sdpa.ScaledDotProductAttention.__init__]
    functions += [keras_sdpa.ScaledDotProductAttention.call, keras_sdpa.BlockMask.__init__]
    functions += [getattr(mods, name) for name in mods.__all__ if name[0].islower()]
    assert len(functions) == 20
    assert unannotated(functions) == []

    def untyped(a, b: int = 1):
        return a

    assert unannotated([untyped]) == [
        "test_every_public_signature_is_typed.<locals>.untyped(a)",
        "test_every_public_signature_is_typed.<locals>.untyped -> ?",
    ]
