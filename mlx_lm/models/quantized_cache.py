"""The quantized KV cache: keys and values stored as MLX affine-quantized triples,
and the (group_size, bits) it accepts. cache.py re-exports both (upstream's home)."""

from typing import Optional, Tuple

import mlx.core as mx

from .cache_base import _AppendOnlyCache, _grow


# What MLX's affine quantization accepts.
KV_BITS = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)


def check_kv_quantization_params(group_size: int, bits: int) -> None:
    if bits not in KV_BITS:
        raise ValueError(f"KV cache quantization supports bits {list(KV_BITS)}, got kv_bits={bits}")
    if group_size not in KV_GROUP_SIZES:
        raise ValueError(
            f"KV cache quantization supports group sizes {list(KV_GROUP_SIZES)}, got kv_group_size={group_size}"
        )


class QuantizedKVCache(_AppendOnlyCache):
    """Keys and values quantized along the head dimension as they arrive.

    Each of keys and values is a (packed, scales, biases) triple: uint32
    (B, H_kv, T, D * bits / 32) and (B, H_kv, T, D / group_size) twice, grown in blocks
    of `step`. Each token row is quantized once, on its own. Attention reads the triples
    with quantized matmuls (`base.quantized_scaled_dot_product_attention`).
    """

    step = 256

    def __init__(self, group_size: int = 64, bits: int = 8):
        check_kv_quantization_params(group_size, bits)
        self.group_size = group_size
        self.bits = bits
        self.keys: Optional[Tuple[mx.array, ...]] = None
        self.values: Optional[Tuple[mx.array, ...]] = None
        self.offset = 0

    def _quantize(self, rows: mx.array) -> Tuple[mx.array, ...]:
        if rows.shape[-1] % self.group_size:
            raise ValueError(
                f"kv_group_size {self.group_size} does not divide the head dimension {rows.shape[-1]}; "
                f"choose one of {[g for g in KV_GROUP_SIZES if rows.shape[-1] % g == 0] or 'none: keep the cache float'}"
            )
        return tuple(mx.quantize(rows, group_size=self.group_size, bits=self.bits))

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Quantize and append (B, H_kv, S, D) keys/values; return both triples up to offset."""
        start, end = self.offset, self.offset + keys.shape[2]
        new_keys, new_values = self._quantize(keys), self._quantize(values)
        if self.keys is None or end > self.keys[0].shape[2]:
            old_keys, old_values = self.keys or (None,) * 3, self.values or (None,) * 3
            self.keys = tuple(_grow(b, start, end, n, self.step) for b, n in zip(old_keys, new_keys))
            self.values = tuple(_grow(b, start, end, n, self.step) for b, n in zip(old_values, new_values))
        for buffer, rows in zip(self.keys + self.values, new_keys + new_values):
            buffer[..., start:end, :] = rows
        self.offset = end
        return self.keys_and_values()

    def keys_and_values(self):
        """The quantized (packed, scales, biases) keys and values held, as
        update_and_fetch returns them, for quantized attention; (None, None) when empty."""
        if self.keys is None:
            return None, None
        return self._upto(self.keys, self.offset), self._upto(self.values, self.offset)

    @staticmethod
    def _upto(triple: Tuple[mx.array, ...], end: int) -> Tuple[mx.array, ...]:
        return tuple(t[..., :end, :] for t in triple)

    @property
    def state(self):
        if self.keys is None:
            return []
        return self._upto(self.keys, self.offset), self._upto(self.values, self.offset)

    @state.setter
    def state(self, value):
        self.keys, self.values = (tuple(value[0]), tuple(value[1])) if len(value) else (None, None)
        self.offset = 0 if self.keys is None else self.keys[0].shape[2]

    @property
    def meta_state(self):
        return tuple(map(str, (self.offset, self.group_size, self.bits)))

    @meta_state.setter
    def meta_state(self, value):
        offset, group_size, bits = map(int, value)
        check_kv_quantization_params(group_size, bits)
        held = 0 if self.keys is None else self.keys[0].shape[2]
        if offset > held:
            raise ValueError(f"QuantizedKVCache offset {offset} exceeds the {held} rows it holds")
        self.offset, self.group_size, self.bits = offset, group_size, bits

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else sum(t.nbytes for t in self.keys + self.values)
