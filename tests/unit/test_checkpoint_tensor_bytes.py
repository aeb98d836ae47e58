"""A tensor's raw bytes (what checksums and in-place reads use): every shape,
an empty one included, and writable in place."""
from __future__ import annotations

import pytest
import torch
import xxhash

from megaresil.checkpoint.format import checksum, tensor_bytes


@pytest.mark.parametrize("shape", [(0, 3), (3, 0, 2), (), (2, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bytes_of_any_shape_are_the_tensors_bytes(shape, dtype):
    t = torch.arange(int(torch.tensor(shape).prod()), dtype=dtype).reshape(shape)
    expected = t.view(torch.int16).numpy().tobytes() if dtype == torch.bfloat16 \
        else t.numpy().tobytes()
    assert bytes(tensor_bytes(t)) == expected
    assert checksum(t) == xxhash.xxh3_64_hexdigest(expected)


def test_the_bytes_write_through_to_the_tensor():
    t = torch.zeros(2, 3)
    tensor_bytes(t)[:] = torch.arange(6.0).numpy().tobytes()
    assert torch.equal(t, torch.arange(6.0).reshape(2, 3))
