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
        "_nodes_by_depth", "_operations_by_depth", "_inbound_nodes", "_outbound_nodes",
        # TensorFlow's Trackable (`setattr` updates them, with the checkpoint's dependencies):
        "_self_unconditional_checkpoint_dependencies", "_self_unconditional_dependency_names",
        "_self_unconditional_deferred_dependencies", "_self_name_based_restores",
        "_self_saveable_object_factories",
    ]
)  # fmt: skip
# Lists, tuples and dicts (Keras's tracked ones and TensorFlow's wrappers subclass them) nest
# this deep at most between a layer and what it holds (TensorFlow wraps each list in a
# list, and an instance's materialized `__dict__` is one more).
_CONTAINERS = (list, tuple, dict)
_DEPTH = 6


def _replaced(value, old, new):
    """`value` with `old` put as `new` at any depth of its lists, tuples and dicts: lists and
    dicts change in place (Keras's tracked ones keep tracking), tuples are made anew."""
    if value is old:
        return new
    if isinstance(value, list):  # TensorFlow's ListWrapper and Keras's TrackedList too
        for i, item in enumerate(list(value)):
            swapped = _replaced(item, old, new)
            if swapped is not item:
                value[i] = swapped
    elif isinstance(value, dict):
        for key, item in list(value.items()):
            swapped = _replaced(item, old, new)
            if swapped is not item:
                value[key] = swapped
    elif isinstance(value, tuple):
        items = [_replaced(item, old, new) for item in value]
        if any(a is not b for a, b in zip(items, value)):
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def _where(value, old, path):
    """The path of `old` inside `value` (its lists, tuples, dicts, sets), or None."""
    if value is old:
        return path
    if isinstance(value, (set, frozenset)):
        return f"{path} (a set)" if any(item is old for item in value) else None
    items = value.items() if isinstance(value, dict) else (
        enumerate(value) if isinstance(value, (list, tuple)) else ()
    )  # fmt: skip
    for key, item in items:
        found = _where(item, old, f"{path}[{key!r}]")
        if found is not None:
            return found
    return None


def replace(parent, old, new, path):
    """Points every attribute of `parent`, and every list, tuple or dict inside one at any
    depth, that holds `old` at `new`; keeps Keras's tracking (the order of `parent.weights`)
    and a functional graph's nodes in place. `ValueError`, naming the place, where `old`
    stays (in a set)."""
    tracker = getattr(parent, "_tracker", None)
    if tracker is not None and tracker.is_in_store("layers", old):
        tracker.replace_tracked_value("layers", old, new)
    for name, value in list(vars(parent).items()):
        if name in _BOOKKEEPING:
            continue  # TensorFlow's and Keras's own records, which their setters keep
        swapped = _replaced(value, old, new)
        if swapped is not value:
            setattr(parent, name, swapped)  # the TF backend's checkpoint dependency follows
        left = _where(swapped, old, f"{parent.name}.{name}")
        if left is not None:
            raise ValueError(
                f"Could not swap {path!r}: `{left}` holds it where it cannot be replaced. "
                "Hold attention layers in attributes, lists, tuples or dicts."
            )
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
    """The Keras layers, other than those whose ids are in `exclude`, that hold one of
    `targets` in an attribute or in lists, tuples or dicts of their attributes.

    Returns `{id(target): [layer, ...]}`. One scan of the heap per level of containers
    (`gc.get_referrers` with every object of the level at once).
    """
    found = {id(target): [] for target in targets}
    frontier = {id(target): target for target in targets}
    origin = {id(target): id(target) for target in targets}  # the target each object leads to
    seen = set(frontier) | {id(found), id(frontier), id(origin)}
    for _ in range(_DEPTH):
        if not frontier:
            break
        objects = list(frontier.values())
        referrers = gc.get_referrers(*objects)
        level = {}
        seen.update({id(objects), id(referrers), id(level)})
        for referrer in referrers:
            if id(referrer) in seen:
                continue
            is_layer = isinstance(referrer, keras.layers.Layer)
            if not (is_layer or isinstance(referrer, _CONTAINERS)):
                continue  # frames, nodes, tensors: not a layer's holding
            seen.add(id(referrer))
            # What it holds: a dict's values (a dict keyed by layers holds no layer in place).
            held = referrer.values() if isinstance(referrer, dict) else gc.get_referents(referrer)
            for target in {origin[id(x)] for x in held if id(x) in frontier}:
                if is_layer and id(referrer) not in exclude:
                    found[target].append(referrer)
                elif not is_layer:
                    level[id(referrer)] = referrer
                    origin[id(referrer)] = target
        frontier = level
    return found


def enclosing(layers, exclude):
    """The Keras layers outside `exclude` that hold any of `layers`, directly or through
    other such layers (the task around a backbone, the model around a block)."""
    out, frontier, exclude = [], list(layers), set(exclude)
    while frontier:
        found = [layer for held in holders(frontier, exclude).values() for layer in held]
        frontier = []
        for layer in found:
            if id(layer) not in exclude:
                exclude.add(id(layer))
                out.append(layer)
                frontier.append(layer)
    return out


def sublayers(layer):
    """The layers Keras tracks as `layer`'s children, and its functional graph's operations."""
    seen, out = set(), []
    for child in list(getattr(layer, "_layers", [])) + list(getattr(layer, "_operations", [])):
        if isinstance(child, keras.layers.Layer) and id(child) not in seen:
            seen.add(id(child))
            out.append(child)
    return out
