"""Where a layer is held, for `replace_attention`: in a parent's attributes and in the lists,
tuples and dicts inside them, at any depth; as a node of a functional graph; and by Keras
layers that the swap did not walk (another model that shares it, the task around a
backbone), found on the heap.
"""

import gc

import keras
from keras.src.ops.node import KerasHistory

# Attributes that record layers for Keras's graph and TensorFlow's checkpoints; the setters
# and `_replace_in_graph` update them.
_BOOKKEEPING = frozenset(
    [
        "_nodes_by_depth",
        "_operations_by_depth",
        "_inbound_nodes",
        "_outbound_nodes",
        # TensorFlow's Trackable (`setattr` updates them, with the checkpoint's dependencies):
        "_self_unconditional_checkpoint_dependencies",
        "_self_unconditional_dependency_names",
        "_self_unconditional_deferred_dependencies",
        "_self_name_based_restores",
        "_self_saveable_object_factories",
    ]
)
# Lists, tuples and dicts (Keras's tracked ones and TensorFlow's wrappers subclass them) nest
# this deep at most between a layer and what it holds (TensorFlow wraps each list in a
# list, and an instance's materialized `__dict__` is one more).
_CONTAINERS = (list, tuple, dict)
_DEPTH = 6


def _replaced(value, old, new, done=None):
    """`value` with `old` put as `new` at any depth of its lists, tuples and dicts: lists and
    dicts change in place (Keras's tracked ones keep tracking), tuples are made anew (the same
    tuple met twice becomes the same new one)."""
    if value is old:
        return new
    if not isinstance(value, _CONTAINERS):
        return value
    done = {} if done is None else done  # id: what the container became
    if id(value) in done:
        return done[id(value)]  # met before, or a container that holds itself
    done[id(value)] = value
    if isinstance(value, list):  # TensorFlow's ListWrapper and Keras's TrackedList too
        for i, item in enumerate(list(value)):
            swapped = _replaced(item, old, new, done)
            if swapped is not item:
                value[i] = swapped
    elif isinstance(value, dict):
        for key, item in list(value.items()):
            swapped = _replaced(item, old, new, done)
            if swapped is not item:
                value[key] = swapped
    else:
        items = [_replaced(item, old, new, done) for item in value]
        if any(a is not b for a, b in zip(items, value)):
            made = type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
            done[id(value)] = made
            return made
    return value


def _places(value, old, path, seen=None):
    """Every path of `old` inside `value` (its lists, tuples, dicts and sets)."""
    if value is old:
        yield path
    elif isinstance(value, (set, frozenset)):
        if any(item is old for item in value):
            yield f"{path} (a set)"
    elif isinstance(value, _CONTAINERS):
        seen = set() if seen is None else seen
        if id(value) in seen:
            return
        seen.add(id(value))
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            yield from _places(item, old, f"{path}[{key!r}]", seen)


def _attributes(parent):
    return [(name, value) for name, value in vars(parent).items() if name not in _BOOKKEEPING]


def check(parent, old, path):
    """`ValueError`, naming the place, where `parent` holds `old` where it cannot be replaced
    (in a set); checked for every parent before anything is swapped."""
    for name, value in _attributes(parent):
        for place in _places(value, old, f"{parent.name}.{name}"):
            if place.endswith("(a set)"):
                raise ValueError(
                    f"Could not swap {path!r}: `{place}` holds it where it cannot be replaced. "
                    "Hold attention layers in attributes, lists, tuples or dicts."
                )


def holds(parent, old):
    """Whether `parent` holds `old` in an attribute, a container of one, or its graph."""
    for name, value in _attributes(parent):
        if next(_places(value, old, name), None) is not None:
            return True
    nodes = (getattr(parent, "_nodes_by_depth", None) or {}).values()
    return any(node.operation is old for level in nodes for node in level)


def replace(parent, old, new):
    """Points every attribute of `parent`, and every list, tuple or dict inside one at any
    depth, that holds `old` at `new`; keeps Keras's tracking (the order of `parent.weights`)
    and a functional graph's nodes in place. `check` comes first."""
    tracker = getattr(parent, "_tracker", None)
    if tracker is not None and tracker.is_in_store("layers", old):
        tracker.replace_tracked_value("layers", old, new)
    for name, value in _attributes(parent):
        swapped = _replaced(value, old, new)
        if swapped is not value:
            setattr(parent, name, swapped)  # the TF backend's checkpoint dependency follows
    _replace_in_graph(parent, old, new)


def _replace_in_graph(parent, old, new):
    """In a functional model: the nodes that call `old` call `new`, under `new`'s keys."""
    by_depth = getattr(parent, "_nodes_by_depth", None)
    if not by_depth:
        return
    found = False
    for nodes in by_depth.values():
        for node in nodes:
            if node.operation is old:
                node.operation = new
            found = found or node.operation is new
    for operations in (getattr(parent, "_operations_by_depth", None) or {}).values():
        for i, operation in enumerate(operations):
            if operation is old:
                operations[i] = new
    if not found:
        return
    if not new._inbound_nodes:  # once, for every graph that calls it
        new._inbound_nodes = list(old._inbound_nodes)
        new._outbound_nodes = list(old._outbound_nodes)
        for index, node in enumerate(new._inbound_nodes):
            for position, tensor in enumerate(node.outputs):  # what a graph's config reads
                tensor._keras_history = KerasHistory(new, index, position)
    keys, prefix = parent._nodes, f"{id(old)}_ib-"
    for key in [key for key in keys if key.startswith(prefix)]:
        keys.discard(key)
        keys.add(f"{id(new)}_ib-{key[len(prefix) :]}")


def holders(targets, exclude):
    """The Keras layers, other than those whose ids are in `exclude`, that hold any of
    `targets` in an attribute or in lists, tuples or dicts of their attributes.

    One scan of the heap per level of containers (`gc.get_referrers` with every object of
    the level at once), after a collection, so that garbage holds nothing.
    """
    gc.collect()
    found, frontier = {}, {id(target): target for target in targets}
    seen = set(frontier) | {id(found), id(frontier)}
    for _ in range(_DEPTH):
        if not frontier:
            break
        objects = list(frontier.values())
        referrers = gc.get_referrers(*objects)
        level = {}
        seen.update({id(objects), id(referrers), id(level)})
        for referrer in referrers:
            if id(referrer) in seen or id(referrer) in exclude:
                continue
            is_layer = isinstance(referrer, keras.layers.Layer)
            if not (is_layer or isinstance(referrer, _CONTAINERS)):
                continue  # frames, nodes, tensors: not a layer's holding
            # What it holds: a dict's values (a dict keyed by layers holds no layer in place).
            held = referrer.values() if isinstance(referrer, dict) else gc.get_referents(referrer)
            if not any(id(x) in frontier for x in held):
                continue
            if is_layer:
                found[id(referrer)] = referrer
            else:
                seen.add(id(referrer))
                level[id(referrer)] = referrer
        frontier = level
    return list(found.values())


def enclosing(layers, exclude):
    """The Keras layers outside `exclude` that hold any of `layers`, directly or through
    other such layers (the task around a backbone, the model around a block)."""
    out, frontier, exclude = [], list(layers), set(exclude)
    while frontier:
        frontier = [layer for layer in holders(frontier, exclude) if id(layer) not in exclude]
        exclude.update(id(layer) for layer in frontier)
        out += frontier
    return out


def sublayers(layer):
    """The layers Keras tracks as `layer`'s children, and its functional graph's operations."""
    seen, out = set(), []
    for child in list(getattr(layer, "_layers", [])) + list(getattr(layer, "_operations", [])):
        if isinstance(child, keras.layers.Layer) and id(child) not in seen:
            seen.add(id(child))
            out.append(child)
    return out
