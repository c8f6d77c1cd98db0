"""Context parallelism: ring attention over a mesh axis that shards the sequence.

With the sequence axis of the queries, keys and values sharded over the `P` devices of one
axis of a `keras.distribution.DeviceMesh`, each device keeps its queries and the key/value
shards travel round the ring: at each of the `P` steps a device attends its queries to the
shard it holds, merges the result into its running maximum, sum and output (the chunked path's
online softmax), and passes the shard to its neighbour. The gradient goes round the ring the
same way, each shard's key and value gradients travelling with it until they are home (Liu,
Zaharia & Abbeel, 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
Context"). No device holds more than one chunk pair's `(c, c)` scores.

Causal attention is balanced over the devices (the zig-zag order of Brandon et al., 2023,
"Striped Attention"'s companion): the sequence is cut into `2P` chunks and device `d` holds
chunks `d` and `2P - 1 - d`, so every device computes the same number of chunk pairs at every
step. A chunk pair that the causal mask or the window empties is skipped. The keys' padding
mask and segment ids travel with the keys; positions are global, so every mask is what it is
on one device.

A call asks for it with `context_parallel="<mesh axis>"` under a `keras.distribution` whose
`DeviceMesh` has that axis (`run`, the core's entry for it). The math is `keras.ops`; the ring
itself (`shard_map`, `ppermute`, the device's index) is the JAX shim's
(`keras_sdpa/_backend/jax.py`); the TensorFlow shim refuses it, naming JAX.
"""

import dataclasses

import keras
from keras import ops

from keras_sdpa import _backend
from keras_sdpa._core import plan as plans
from keras_sdpa._core import softmax
from keras_sdpa._mods import bands, builtin
from keras_sdpa._shared import checks


@dataclasses.dataclass(frozen=True)
class Ring:
    """The static facts of a ring call."""

    axis: str  # the mesh axis that shards the sequence
    devices: int  # P, the devices on that axis
    per_device: int  # chunks a device holds: 2 (zig-zag) when causal, else 1
    q_chunk: int  # queries in a chunk
    k_chunk: int  # keys in a chunk
    is_causal: bool
    window: int | None
    masks: tuple[bool, bool] = (False, False)  # a key padding mask; segment ids
    k_block: int = 0  # keys a block of a chunk pair (0: the largest that fits MAX_KEY_BLOCK)
    compute: str = "float32"  # the softmax's precision: float64 for float64 inputs
    count_visits: bool = False  # tests: return each device's computed chunk pairs instead

    def __post_init__(self):
        if not self.k_block:
            object.__setattr__(self, "k_block", key_block(self.k_chunk))

    def counting(self):
        """The same ring, returning each device's number of computed chunk pairs."""
        return dataclasses.replace(self, count_visits=True)


# The most keys a block of a chunk pair holds: the `(c, C)` scores of a step stay small while
# the chunks grow with T.
MAX_KEY_BLOCK = 512


def key_block(k_chunk):
    """The largest divisor of a chunk's keys that is at most `MAX_KEY_BLOCK`."""
    return max(d for d in range(1, min(k_chunk, MAX_KEY_BLOCK) + 1) if k_chunk % d == 0)


def chunk_ids(device, ring):
    """The global chunk indices a device holds: `d`, and `2P - 1 - d` when zig-zagged."""
    if ring.per_device == 1:
        return (device,)
    return (device, 2 * ring.devices - 1 - device)


def zigzag_destinations(devices):
    """Where each device sends its first and its second chunk to lay the sequence out zig-zag:
    device `d` holds chunks `2d` and `2d + 1` as the user's sharding lays them (in order), and
    after the two sends device `e` holds chunks `e` and `2P - 1 - e`."""

    def holder(chunk):
        return chunk if chunk < devices else 2 * devices - 1 - chunk

    return [holder(2 * d) for d in range(devices)], [holder(2 * d + 1) for d in range(devices)]


def _to_zigzag(x, ring, axis):
    """A device's two chunks in order (along `axis`) to its zig-zag pair `(e, 2P - 1 - e)`:
    the even chunk of the pair comes with the first sends, the odd one with the second."""
    shim = _backend.get()
    first, second = ops.split(x, 2, axis=axis)
    to_first, to_second = zigzag_destinations(ring.devices)
    firsts = shim.ring_send(first, ring.axis, to_first)  # chunk 2d, now at its holder
    seconds = shim.ring_send(second, ring.axis, to_second)
    even = ops.equal(shim.ring_index(ring.axis) % 2, 0)  # then chunk e is a first half
    return ops.concatenate(
        [ops.where(even, firsts, seconds), ops.where(even, seconds, firsts)], axis
    )


def _from_zigzag(x, ring, axis):
    """The inverse of `_to_zigzag`: each chunk back to device `chunk // 2`, in order."""
    shim = _backend.get()
    mine, mirrored = ops.split(x, 2, axis=axis)  # chunks e and 2P - 1 - e
    even = ops.equal(shim.ring_index(ring.axis) % 2, 0)
    evens, odds = ops.where(even, mine, mirrored), ops.where(even, mirrored, mine)
    last = 2 * ring.devices - 1
    even_chunk = [e if e % 2 == 0 else last - e for e in range(ring.devices)]
    odd_chunk = [last - e if e % 2 == 0 else e for e in range(ring.devices)]
    firsts = shim.ring_send(evens, ring.axis, [c // 2 for c in even_chunk])
    seconds = shim.ring_send(odds, ring.axis, [c // 2 for c in odd_chunk])
    return ops.concatenate([firsts, seconds], axis=axis)


def pair_is_empty(q_id, k_id, ring):
    """Whether the causal mask or the window masks every query of chunk `q_id` against every
    key of chunk `k_id` (traced scalars)."""
    q_first, k_first = q_id * ring.q_chunk, k_id * ring.k_chunk
    q_last, k_last = q_first + ring.q_chunk - 1, k_first + ring.k_chunk - 1
    empty = ops.convert_to_tensor(False)
    if ring.is_causal:
        empty = ops.logical_or(empty, q_last < k_first)
    if ring.window is not None:
        empty = ops.logical_or(empty, q_first - k_last >= ring.window)
        empty = ops.logical_or(empty, k_first - q_last >= ring.window)
    return empty


def _split(x, parts, axis):
    return [x] if parts == 1 else ops.split(x, parts, axis=axis)


def _pass(tree, ring):
    """Every array of `tree` to the next device of the ring."""
    return _backend.get().ring_send(
        tree, ring.axis, [(d + 1) % ring.devices for d in range(ring.devices)]
    )


class _Pair:
    """One chunk pair: its queries against its keys in blocks of `ring.k_block` keys, so that
    no `(c, c)` scores are formed; each block masked with the dense path's additive penalty."""

    def __init__(self, ring, q, q_pos, q_seg, k, v, k_pos, keys, k_seg):
        self.ring, self.q, self.q_pos, self.q_seg = ring, q, q_pos, q_seg
        self.k, self.v, self.k_pos, self.keys, self.k_seg = k, v, k_pos, keys, k_seg
        self.blocks = ring.k_chunk // ring.k_block

    def _keys(self, x, start, axis):
        """`x`'s block of keys from `start` along `axis`."""
        begin = [0] * len(ops.shape(x))
        begin[axis] = start
        size = list(ops.shape(x))
        size[axis] = self.ring.k_block
        return ops.slice(x, begin, size)

    def block(self, n):
        """Key block `n`: `(scores (B, K, G, c, C), keys (B, K, C, H), values (B, K, C, Hv))`."""
        start = n * self.ring.k_block
        k, v = self._keys(self.k, start, 2), self._keys(self.v, start, 2)
        scores = ops.einsum("bkgth,bksh->bkgts", self.q, k)
        k_pos = self._keys(self.k_pos, start, 0)
        allowed = bands.band(self.q_pos, k_pos, self.ring.is_causal, self.ring.window)
        allowed = None if allowed is None else allowed[None, None, None]
        if self.keys is not None:
            keys = self._keys(self.keys, start, 1)
            allowed = softmax.combine(allowed, keys[:, None, None, None, :])
        if self.q_seg is not None:
            same = ops.equal(self.q_seg[:, :, None], self._keys(self.k_seg, start, 1)[:, None, :])
            allowed = softmax.combine(allowed, same[:, None, None])
        if allowed is not None:
            scores = scores + ops.where(allowed, 0.0, softmax.MASK_PENALTY)
        return scores, k, v

    def add_to_block(self, x, n, block):
        """`x` `(B, K, c, H)` with `block` added into key block `n`."""
        start = n * self.ring.k_block
        return ops.slice_update(x, (0, 0, start, 0), self._keys(x, start, 2) + block)


class _Device:
    """One device's side of the ring: its queries' chunks and the shard it holds."""

    def __init__(self, ring, q, q_seg):
        self.ring, self.shim = ring, _backend.get()
        self.me = self.shim.ring_index(ring.axis)
        self.q_ids = chunk_ids(self.me, ring)
        self.qs = _split(q, ring.per_device, 3)
        self.q_segs = _split(q_seg, ring.per_device, 1) if q_seg is not None else None

    def pairs(self, step, shard):
        """`(i, j, empty, pair_fn)` for each of this device's query chunks `i` and each key
        chunk `j` of the shard it holds at `step` (the one `step` devices before it)."""
        ring = self.ring
        source = (self.me - step) % ring.devices
        k, v, keys, k_seg = shard
        ks, vs = _split(k, ring.per_device, 2), _split(v, ring.per_device, 2)
        keyss = _split(keys, ring.per_device, 1) if keys is not None else None
        k_segs = _split(k_seg, ring.per_device, 1) if k_seg is not None else None
        for i, q_id in enumerate(self.q_ids):
            q_pos = q_id * ring.q_chunk + ops.arange(ring.q_chunk)
            for j, k_id in enumerate(chunk_ids(source, ring)):
                k_pos = k_id * ring.k_chunk + ops.arange(ring.k_chunk)

                def pair(i=i, j=j, q_pos=q_pos, k_pos=k_pos):
                    return _Pair(
                        ring,
                        self.qs[i],
                        q_pos,
                        None if self.q_segs is None else self.q_segs[i],
                        ks[j],
                        vs[j],
                        k_pos,
                        None if keyss is None else keyss[j],
                        None if k_segs is None else k_segs[j],
                    )

                yield i, j, pair_is_empty(q_id, k_id, ring), pair


def _forward(ring, q, k, v, keys, q_seg, k_seg):
    """This device's output `(B, K, G, t, Hv)` and log-sum-exp `(B, K, G, t)`, and the number
    of chunk pairs it computed."""
    device = _Device(ring, q, q_seg)
    b, heads, groups, _, _ = ops.shape(q)
    zeros = ops.zeros((b, heads, groups, ring.q_chunk), ring.compute)
    states = [
        (
            ops.zeros((*ops.shape(zeros), ops.shape(v)[-1]), ring.compute),
            zeros + softmax.MASKED_SCORE,
            zeros,
        )
        for _ in device.qs
    ]

    def merge(state, pair):
        pair = pair()

        def key_block(n, state):
            o, m, total = state
            scores, _, v = pair.block(n)
            new_m = ops.maximum(m, ops.max(scores, axis=-1))
            p = ops.exp(scores - new_m[..., None])
            rescale = ops.exp(m - new_m)
            o = o * rescale[..., None] + ops.einsum("bkgts,bksh->bkgth", p, v)
            return o, new_m, total * rescale + ops.sum(p, axis=-1)

        return ops.fori_loop(0, pair.blocks, key_block, state)

    def visit(step, states, visits, shard):
        states = list(states)
        for i, _, empty, pair in device.pairs(step, shard):
            state = states[i]
            states[i] = ops.cond(
                empty, lambda state=state: state, lambda s=state, p=pair: merge(s, p)
            )
            visits = visits + ops.where(empty, 0, 1)
        return states, visits

    def step(n, carry):
        states, visits, shard = carry
        states, visits = visit(n, states, visits, shard)
        return states, visits, _pass(shard, ring)

    carry = (states, ops.zeros((), "int32"), (k, v, keys, k_seg))
    states, visits, shard = ops.fori_loop(0, ring.devices - 1, step, carry)
    states, visits = visit(ring.devices - 1, states, visits, shard)
    outs, lses = [], []
    for o, m, total in states:
        seen = m > 0.5 * softmax.MASK_PENALTY  # False on a row with no allowed key: zeros
        outs.append(ops.where(seen[..., None], o / ops.where(seen, total, 1.0)[..., None], 0.0))
        lses.append(
            ops.where(seen, m + ops.log(ops.where(seen, total, 1.0)), -softmax.MASK_PENALTY)
        )
    return ops.concatenate(outs, axis=3), ops.concatenate(lses, axis=3), visits


def _backward(ring, q, k, v, keys, q_seg, k_seg, out, lse, d_out):
    """`dq`, `dk`, `dv` of this device's shards: the key and value gradients go round the
    ring with their shard and are home after `P` passes."""
    device = _Device(ring, q, q_seg)
    row_dot = ops.sum(d_out * out, axis=-1)  # (B, K, G, t)
    d_outs, row_dots = _split(d_out, ring.per_device, 3), _split(row_dot, ring.per_device, 3)
    lses = _split(lse, ring.per_device, 3)

    def grads_of(i, dq, dk, dv, pair):
        pair = pair()

        def key_block(n, grads):
            dq, dk, dv = grads
            scores, k, v = pair.block(n)
            p = ops.exp(scores - lses[i][..., None])
            dv = pair.add_to_block(dv, n, ops.einsum("bkgts,bkgth->bksh", p, d_outs[i]))
            d_p = ops.einsum("bkgth,bksh->bkgts", d_outs[i], v)
            d_scores = p * (d_p - row_dots[i][..., None])
            dq = dq + ops.einsum("bkgts,bksh->bkgth", d_scores, k)
            dk = pair.add_to_block(dk, n, ops.einsum("bkgts,bkgth->bksh", d_scores, pair.q))
            return dq, dk, dv

        return ops.fori_loop(0, pair.blocks, key_block, (dq, dk, dv))

    def visit(step, dqs, shard, travelling):
        dqs = list(dqs)
        dks = _split(travelling[0], ring.per_device, 2)
        dvs = _split(travelling[1], ring.per_device, 2)
        for i, j, empty, pair in device.pairs(step, shard):
            now = (dqs[i], dks[j], dvs[j])
            dqs[i], dks[j], dvs[j] = ops.cond(
                empty, lambda now=now: now, lambda now=now, i=i, p=pair: grads_of(i, *now, p)
            )
        return dqs, (ops.concatenate(dks, axis=2), ops.concatenate(dvs, axis=2))

    def step(n, carry):
        dqs, shard, travelling = carry
        dqs, travelling = visit(n, dqs, shard, travelling)
        return dqs, _pass(shard, ring), _pass(travelling, ring)

    dqs = [ops.zeros_like(x) for x in device.qs]
    carry = (dqs, (k, v, keys, k_seg), (ops.zeros_like(k), ops.zeros_like(v)))
    dqs, shard, travelling = ops.fori_loop(0, ring.devices - 1, step, carry)
    dqs, travelling = visit(ring.devices - 1, dqs, shard, travelling)
    dk, dv = _pass(travelling, ring)  # the last pass brings them home
    return ops.concatenate(dqs, axis=3), dk, dv


def _device_program(ring, scale, dtype, num_kv_heads):
    """The program each device runs on its shards, in the layout of the public function."""
    shim = _backend.get()
    has_keys, has_segments = ring.masks

    def program(query, key, value, *masks):
        if ring.per_device == 2:  # chunks d and 2P - 1 - d on device d: the work balanced
            query, key, value = (_to_zigzag(x, ring, 1) for x in (query, key, value))
            masks = [_to_zigzag(x, ring, 1) for x in masks]
        masks = list(masks)
        keys = masks.pop(0) if has_keys else None
        q_seg, k_seg = (masks[0], masks[1]) if has_segments else (None, None)
        b, t, n, h = ops.shape(query)
        q = ops.transpose(ops.cast(query, ring.compute), (0, 2, 1, 3)) * scale  # (B, N, t, H)
        q = ops.reshape(q, (b, num_kv_heads, n // num_kv_heads, t, h))
        k = ops.transpose(ops.cast(key, ring.compute), (0, 2, 1, 3))  # (B, K, s, H)
        v = ops.transpose(ops.cast(value, ring.compute), (0, 2, 1, 3))
        if ring.count_visits:
            return ops.reshape(_forward(ring, q, k, v, keys, q_seg, k_seg)[2], (1,))

        def forward(q, k, v):
            out, lse, _ = _forward(ring, q, k, v, keys, q_seg, k_seg)

            def grad(d_out):
                return _backward(ring, q, k, v, keys, q_seg, k_seg, out, lse, d_out)

            return out, grad

        out = shim.custom_gradient(forward)(q, k, v)  # (B, K, G, t, Hv)
        out = ops.reshape(out, (b, n, t, ops.shape(out)[-1]))
        out = ops.cast(ops.transpose(out, (0, 2, 1, 3)), dtype)
        return _from_zigzag(out, ring, 1) if ring.per_device == 2 else out

    return program


def _attend(query, key, value, key_mask, segment_ids, *, ring, mesh, scale):
    """The ring's program over the whole mesh, each device on its shards as the user's
    sharding lays them (in order along the sequence)."""
    arrays = [query, key, value]
    arrays += [] if key_mask is None else [key_mask]
    arrays += [] if segment_ids is None else [segment_ids, segment_ids]
    program = _device_program(ring, scale, query.dtype, key.shape[2])
    return _backend.get().ring_map(program, mesh, ring.axis, arrays, ring.count_visits)


# One program per ring, mesh and scale (and input shapes): a `jax.jit`.
compiled = _backend.compile(_attend, static_argnames=("ring", "mesh", "scale"))


def run(query, key, value, mask, bias, request):
    """The core's call with `request.context_parallel` set: checked, then the ring's program."""
    mesh, devices = _backend.get().ring_mesh(request.context_parallel)
    query, key, value = (ops.convert_to_tensor(x) for x in (query, key, value))
    checks.check_inputs(query, key, value)
    _check_options(request, bias)
    mask_mod, is_causal, window = plans.lower_mask_mod(
        request.mask_mod, request.is_causal, request.sliding_window
    )  # mods.causal() and mods.sliding_window(w) are the ring's own masks
    request = request.replace(mask_mod=mask_mod, is_causal=is_causal, sliding_window=window)
    (b, t), s = query.shape[:2], key.shape[1]
    per_device = 2 if request.is_causal else 1
    _check_lengths(request, t, s, devices * per_device)
    dtype = keras.backend.standardize_dtype(query.dtype)
    ring = Ring(
        axis=request.context_parallel,
        devices=devices,
        per_device=per_device,
        q_chunk=t // (devices * per_device),
        k_chunk=s // (devices * per_device),
        is_causal=bool(request.is_causal),
        window=request.sliding_window,
        masks=(mask is not None, request.mask_mod is not None),
        compute="float64" if dtype == "float64" else "float32",
    )
    key_mask = None if mask is None else _key_mask(mask, query, key)
    segment_ids = None if request.mask_mod is None else _segment_ids(request.mask_mod, b, t, s)
    scale = request.scale_for(query.shape[-1])
    return compiled(query, key, value, key_mask, segment_ids, ring=ring, mesh=mesh, scale=scale)


# What the ring does not take yet, and what to use instead.
NOT_ON_THE_RING = (
    ("return_weights", "the weights are `(T, S)`: no device holds them"),
    ("attn_logits_soft_cap", "not on the ring yet"),
    ("score_mod", "not on the ring yet"),
    ("block_mask", "the ring skips the chunk pairs that `is_causal` and `sliding_window` empty"),
)


def _check_options(request, bias):
    for name, why in NOT_ON_THE_RING:
        value = getattr(request, name)
        if value is not None and value is not False:
            raise ValueError(
                f"`{name}` is not taken with `context_parallel` ({why}). Received: {name}={value!r}"
            )
    if bias is not None:
        raise ValueError(
            "A `bias` cannot travel round the ring with `context_parallel`: its `(T, S)` "
            "values would be on every device. Use `is_causal`, `sliding_window`, a key "
            "padding `mask` or `mods.document(segment_ids)` instead. Received: a bias of shape "
            f"{tuple(bias.shape)}"
        )
    if request.training and request.dropout_rate > 0.0:
        raise ValueError(
            "Dropout is not on the ring yet with `context_parallel`. "
            f"Received: dropout_rate={request.dropout_rate}"
        )


def _check_lengths(request, t, s, chunks):
    if (request.is_causal or request.sliding_window is not None) and t != s:
        raise ValueError(
            "`context_parallel` with `is_causal` or `sliding_window` takes self-attention "
            f"(T == S). Received: T={t}, S={s}"
        )
    if t % chunks or s % chunks:
        raise ValueError(
            f"`context_parallel` cuts the sequence into {chunks} equal chunks (2 a device when "
            f"causal): T and S must be multiples of {chunks}. Received: T={t}, S={s}"
        )


def _key_mask(mask, query, key):
    """A mask that only masks keys, `(B|1, 1, 1, S)` as the core broadcasts it (so `(S,)` and
    `(B|1, 1, 1, S)` alike), as `(B, S)` booleans: what travels with the keys. A mask along
    the heads or the queries is refused."""
    mask, pattern = checks.check_mask(ops.convert_to_tensor(mask), query, key)
    if pattern[1] or pattern[2]:
        raise ValueError(
            "With `context_parallel`, `mask` may only mask keys, `(B, 1, 1, S)` (it travels "
            "with them): a mask along the heads or the queries would be on every device. Use "
            "`is_causal`, `sliding_window` or `mods.document(segment_ids)` for the rest. "
            f"Received: mask of shape {tuple(mask.shape)} as (B, N, T, S)"
        )
    b, s = query.shape[0], key.shape[1]
    return ops.broadcast_to(ops.reshape(mask, (ops.shape(mask)[0], s)), (b, s))


def _segment_ids(mask_mod, b, t, s):
    """A `mods.document(segment_ids)`'s `(B|1, T)` ids as `(B, T)`, which travel with the keys;
    any other `mask_mod` is refused."""
    document = isinstance(mask_mod, builtin.Document)
    if not document or mask_mod.segment_ids is None or mask_mod.kv_segment_ids is not None:
        kind = type(mask_mod).__name__
        if document:
            kind = "document() without ids" if mask_mod.segment_ids is None else kind
            kind = "document() with kv_segment_ids" if mask_mod.kv_segment_ids is not None else kind
        raise ValueError(
            "With `context_parallel`, the only `mask_mod` is `mods.document(segment_ids)` "
            "with one set of `(B, T)` ids (self-attention), which travel with the keys. "
            f"Received: a mask_mod {kind}"
        )
    ids = ops.convert_to_tensor(mask_mod.segment_ids)
    if len(ids.shape) != 2 or ids.shape[1] != t or ids.shape[0] not in (1, b) or t != s:
        raise ValueError(
            "With `context_parallel`, `mods.document`'s segment ids must be `(B, T)` for "
            f"self-attention (T == S). Received: segment_ids of shape {tuple(ids.shape)} for "
            f"B={b}, T={t}, S={s}"
        )
    return ops.broadcast_to(ids, (b, t))
