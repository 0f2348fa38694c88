"""load_trace: one clear InputError for every bad input, and never another exception (hypothesis)."""

import io
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_place.errors import InputError
from moe_place.traces import Trace, load_trace
from moe_place.traces.content import TORCH_LEGACY_MAGIC


def _write(path, data):
    (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)
    return path


def _npz(path, **arrays):
    np.savez(path, **arrays)
    return path


def _valid_token_npz(path):
    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((64, 3, 16)), axis=2)[:, :, :4].astype(np.int16)
    return _npz(path, format_version=1, num_experts=16, top_k=4, topk_ids=ids)


def _truncated(path):
    data = _valid_token_npz(path).read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def _repeat(path):
    ids = np.array([[[0, 1], [2, 3]], [[1, 2], [3, 3]]])
    return _npz(path, num_experts=4, topk_ids=ids)


# name -> (make(tmp_path) -> path, a fragment the one-line message must contain)
BAD_FILES = {
    "missing path": (lambda d: d / "nope.npz", "no such file"),
    "directory": (lambda d: d, "a directory"),
    "empty file": (lambda d: _write(d / "e.npz", b""), "an empty file"),
    "truncated npz": (lambda d: _truncated(d / "t.npz"), "a zip archive without its end record"),
    "garbage npz": (lambda d: _write(d / "g.npz", b"PK\x03\x04 not a zip at all"), "a zip archive without its end record"),
    "unsupported file": (lambda d: _write(d / "x.txt", "hello"), "supported trace format"),
    "float ids": (lambda d: _npz(d / "f.npz", topk_ids=np.zeros((2, 1, 2))), "topk_ids"),
    "ids of wrong shape": (lambda d: _npz(d / "s.npz", topk_ids=np.zeros((4, 2), dtype=int)), "topk_ids"),
    "counts of wrong shape": (lambda d: _npz(d / "c.npz", counts=np.ones((3, 4), dtype=int)), "counts"),
    "string counts": (lambda d: _npz(d / "u.npz", counts=np.array([[["a"]]])), "counts"),
    "id out of range": (lambda d: _npz(d / "r.npz", num_experts=4, topk_ids=np.array([[[0, 4]]])), "expert ids in [0, 4)"),
    "negative id": (lambda d: _npz(d / "n.npz", topk_ids=np.array([[[-1, 2]]])), "expert ids in"),
    "repeated expert": (lambda d: _repeat(d / "p.npz"), "repeated expert at token 1, layer 1"),
    "num_experts disagrees": (lambda d: _npz(d / "m.npz", num_experts=7, counts=np.ones((1, 1, 8), dtype=int)), "num_experts"),
    "top_k disagrees": (lambda d: _npz(d / "k.npz", top_k=3, topk_ids=np.array([[[0, 1]]])), "top_k"),
    "negative counts": (lambda d: _npz(d / "neg.npz", counts=np.array([[[3, -1, 2]]])), "counts >= 0"),
    "NaN counts": (lambda d: _npz(d / "nan.npz", counts=np.array([[[3.0, np.nan, 2.0]]])), "finite"),
    "all-zero counts": (lambda d: _npz(d / "z.npz", counts=np.zeros((2, 2, 4), dtype=int)), "non-empty"),
    "no tokens": (lambda d: _npz(d / "nt.npz", num_experts=4, topk_ids=np.zeros((0, 2, 2), dtype=int)), "topk_ids"),
    "pickled object array": (lambda d: _npz(d / "o.npz", counts=np.array([[[{}]]], dtype=object)), "counts"),
    "bad json": (lambda d: _write(d / "b.json", '{"counts": [[[1, 2]'), "valid JSON"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_input_is_one_named_input_error(tmp_path, case):
    make, fragment = BAD_FILES[case]
    path = make(tmp_path)
    with pytest.raises(InputError) as err:
        load_trace(path)
    message = str(err.value)
    assert fragment in message and str(path) in message and "\n" not in message


# ---------------------------------------------------------------------- hypothesis
def _check(path, **options):
    try:
        trace = load_trace(path, **options)
    except InputError as exc:
        assert "\n" not in str(exc)
        return
    assert isinstance(trace, Trace) and trace.num_steps >= 1 and trace.total_counts().sum() > 0


@st.composite
def arrays(draw):
    dtype = draw(st.sampled_from(["int8", "int16", "uint8", "int64", "uint64", "float32", "float64", "bool", "U2"]))
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=4))
    size = int(np.prod(shape)) if shape else 1
    if dtype.startswith("U"):
        values = draw(st.lists(st.text(max_size=2), min_size=size, max_size=size))
    elif dtype.startswith("float"):
        values = draw(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=size, max_size=size))
    elif dtype == "bool":
        values = draw(st.lists(st.booleans(), min_size=size, max_size=size))
    else:
        info = np.iinfo(dtype)
        values = draw(st.lists(st.integers(max(info.min, -3), min(info.max, 300)), min_size=size, max_size=size))
    return np.array(values, dtype=dtype).reshape(shape)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(main=st.sampled_from(["counts", "topk_ids"]), array=arrays(),
       extra=st.dictionaries(st.sampled_from(["num_experts", "top_k", "format_version", "layer_ids", "step",
                                              "step_names", "model"]), arrays(), max_size=3))
def test_random_npz_contents_load_or_raise_input_error(tmp_path, main, array, extra):
    path = tmp_path / "h.npz"
    np.savez(path, **{main: array}, **extra)
    _check(path)
    _check(path, max_token_bytes=0)  # token files streamed


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_damaged_npz_bytes_load_or_raise_input_error(tmp_path, data):
    good = io.BytesIO()
    rng = np.random.default_rng(1)
    ids = np.argsort(rng.random((8, 2, 6)), axis=2)[:, :, :2].astype(np.int16)
    compress = data.draw(st.booleans())
    (np.savez_compressed if compress else np.savez)(good, num_experts=6, top_k=2, topk_ids=ids, step=np.arange(8) % 3)
    raw = bytearray(good.getvalue())
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.one_of(st.none(), st.integers(1, len(raw))))
    path = tmp_path / "d.npz"
    path.write_bytes(bytes(raw[:cut]))
    _check(path, max_token_bytes=data.draw(st.sampled_from([None, 0])))  # read whole, or streamed


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.lists(st.one_of(st.integers(-2, 9), st.text(max_size=3)), min_size=3, max_size=5), max_size=6),
       meta=st.lists(st.sampled_from(["# num_experts: 4", "# top_k: 2", "# top_k: x", "# num_experts: 0", "# model: a"]),
                     max_size=2))
def test_random_csv_loads_or_raises_input_error(tmp_path, rows, meta):
    path = tmp_path / "h.csv"
    lines = meta + ["step,layer,expert,count"] + [",".join(map(str, r)) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    _check(path)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(obj=st.recursive(st.one_of(st.integers(-3, 10), st.floats(), st.text(max_size=3), st.none(), st.booleans()),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                            st.sampled_from(["counts", "num_experts", "top_k", "layer_ids", "step_names"]), inner,
                            max_size=4), max_leaves=20))
def test_random_json_loads_or_raises_input_error(tmp_path, obj):
    path = tmp_path / "h.json"
    path.write_text(json.dumps(obj))
    _check(path)


def test_pt_file_without_torch_is_a_clear_input_error(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    path = _write(tmp_path / "dump.pt", TORCH_LEGACY_MAGIC + b".")  # starts as torch.save's legacy format
    with pytest.raises(InputError, match="torch installed") as err:
        load_trace(path)
    assert str(path) in str(err.value)


def _npz_with_ids_shifted(path, ids, shift):
    """An npz whose `topk_ids.npy` member is stored `shift` bytes further into the file than usual
    (an extra field in its local header), so its ids may be misaligned for their dtype."""
    import zipfile

    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, ids)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        info = zipfile.ZipInfo("topk_ids.npy")
        if shift:
            info.extra = (0xCAFE).to_bytes(2, "little") + (shift - 4).to_bytes(2, "little") + b"\0" * (shift - 4)
        zf.writestr(info, buffer.getvalue())


@pytest.mark.parametrize("shift", [0, 5, 8])
def test_a_stored_member_is_mapped_when_aligned_and_read_otherwise_with_the_same_trace(tmp_path, shift):
    from moe_place.traces.npz_member import IdsReader

    rng = np.random.default_rng(shift)
    ids = np.stack([rng.permutation(16)[:4] for _ in range(300)]).reshape(100, 3, 4).astype(np.int16)
    path = tmp_path / "t.npz"
    _npz_with_ids_shifted(path, ids, shift)
    with IdsReader(path) as reader:
        mapped = reader.map_all()
        read = reader.read_all()
    if shift % 2:
        assert mapped is None  # int16 ids an odd number of bytes into the file: read, not mapped
        assert read.flags.writeable
    else:
        assert mapped is not None and not mapped.flags.writeable
        np.testing.assert_array_equal(mapped, ids)
    np.testing.assert_array_equal(read, ids)
    trace = load_trace(path)
    expected = np.stack([np.bincount(ids[:, layer].ravel(), minlength=16) for layer in range(3)])
    np.testing.assert_array_equal(trace.total_counts(), expected)


def test_a_stored_member_shorter_than_its_header_is_not_mapped_and_names_the_truncation(tmp_path):
    import zipfile

    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": "<i2", "fortran_order": False, "shape": (60, 2, 1)})
    buffer.write(np.zeros((50, 2, 1), dtype="<i2").tobytes())  # 50 of the 60 tokens the header promises
    path = tmp_path / "t.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("topk_ids.npy", buffer.getvalue())
    with pytest.raises(InputError, match="topk_ids.*truncated file"):
        load_trace(path)
