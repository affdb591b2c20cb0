"""The vLLM 0.33 Triton-attention peer (``paper/peers/vllm_triton.py``) against our references.

vLLM's files are not in the repository: the kernel tests skip unless
``python -m paper.peers.vllm_triton --fetch`` has filled ``paper/peers/vllm-0.33``. They run
vLLM's kernel under the Triton interpreter, on our cache layouts, through both of its paths
(split-K "3D" and single-pass "2D"), and check which path ran from the split-K scratch.
"""

from __future__ import annotations

import math
import sys
import zipfile

import pytest
import torch
from kernel_tests.paged import synthetic_caches

from hybridkv_kernels.paged_decode import paged_decode_attention_ref
from hybridkv_kernels.paged_prefill import paged_prefill_attention_ref
from paper.peers import vllm_triton as vt

needs_vllm = pytest.mark.skipif(
    not vt.available(), reason=f"vLLM 0.33 not fetched into {vt.FOLDER}: {vt.FETCH_COMMAND}"
)
# vLLM feeds P to the P @ V dot in the cache dtype; the references keep it in float32
TOL = {torch.float32: 2e-5, torch.float16: 4e-3}
HQ, HKV, D = 8, 2, 64


def _fill(k_cache, v_cache, lens, dtype):
    """Random K/V per request through shuffled block tables; columns past a request's blocks
    hold an id far outside the cache (the kernel reads them, it must mask what they address)."""
    num_blocks, block_size = k_cache.shape[:2]
    need = [math.ceil(n / block_size) for n in lens]
    free = torch.randperm(num_blocks - 1)[: sum(need)] + 1
    tables = torch.full((len(lens), max(need)), 10**6, dtype=torch.int32)
    for b, (n, nb) in enumerate(zip(lens, need)):
        tables[b, :nb], free = free[:nb].int(), free[nb:]
        pos = torch.arange(n)
        blocks = tables[b, pos // block_size].long()
        k_cache[blocks, pos % block_size] = torch.randn(n, *k_cache.shape[2:]).to(dtype)
        v_cache[blocks, pos % block_size] = torch.randn(n, *v_cache.shape[2:]).to(dtype)
    return tables


def _check(layout, dtype, block_size, lens, q_lens=None, max_num_seqs=1024, window=None):
    """Run the peer against the reference; return whether it took the split-K path."""
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 4
    _, k, v = synthetic_caches(layout, num_blocks, block_size, HKV, D, D, dtype)
    tables = _fill(k, v, lens, dtype)  # NaN outside the requests' tokens, garbage past tables
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    layer = vt.VllmTritonAttention(
        HQ, HKV, D, D**-0.5, sliding_window=window, max_num_seqs=max_num_seqs
    )
    layer.softmax_segm_max.fill_(float("nan"))
    if q_lens is None:
        q = torch.randn(len(lens), HQ, D).to(dtype)
        run = layer.prepare(q, k, v, tables, seq_lens, out=torch.full_like(q, float("nan")))
        want = paged_decode_attention_ref(q, k, v, tables, seq_lens, D**-0.5, window)
        split = layer.uses_split_k(len(lens), 1, len(lens))
    else:
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        q = torch.randn(int(cu[-1]), HQ, D).to(dtype)
        run = layer.prepare(q, k, v, tables, seq_lens, cu, out=torch.full_like(q, float("nan")))
        want = paged_prefill_attention_ref(q, k, v, tables, cu, seq_lens, D**-0.5, window)
        split = layer.uses_split_k(len(lens), max(q_lens), q.shape[0])
    got = run()
    assert not torch.isnan(got).any()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOL[dtype], err
    ran_3d = not torch.isnan(layer.softmax_segm_max).all()
    assert ran_3d == split
    return split


@needs_vllm
# the 2D kernel divides the rows it masks out (query slots past a request's last token) 0 / 0
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
@pytest.mark.parametrize(
    "layout, dtype, block_size, lens, q_lens, max_num_seqs, window, split",
    [
        pytest.param("classic", torch.float16, 16, [1, 40, 200], None, 1024, None, True,
                     id="decode-3d-fp16"),
        pytest.param("head-major", torch.float32, 64, [1, 40, 300], None, 2, None, False,
                     id="decode-2d-fp32-small-scratch"),
        pytest.param("packed3-layer1", torch.float16, 16, [5, 40, 100], [5, 17, 33], 1024, None,
                     False, id="prefill-2d-fp16-cached-prefix"),
        pytest.param("layer-outer", torch.float32, 64, [1, 40, 90], [1, 3, 8], 1024, None,
                     True, id="extend-3d-fp32-short-queries"),
        pytest.param("classic", torch.float16, 16, [9, 100], None, 1024, 32, True,
                     id="decode-3d-window32"),
    ],
)  # fmt: skip
def test_peer_matches_reference(
    layout, dtype, block_size, lens, q_lens, max_num_seqs, window, split
):
    torch.manual_seed(0)
    assert _check(layout, dtype, block_size, lens, q_lens, max_num_seqs, window) == split


@needs_vllm
def test_backend_sizing():
    """The builder's threshold (128 // Hkv, snapped to a capture size) and scratch shapes."""
    layer = vt.VllmTritonAttention(24, 3, 80, 1.0)
    assert layer.seq_threshold_3D == 40  # 42 -> nearest capture size
    assert (
        vt.VllmTritonAttention(24, 3, 80, 1.0, cudagraph_capture_sizes=None).seq_threshold_3D == 42
    )
    assert layer.softmax_segm_output.shape == (40, 24, 16, 128)
    assert layer.softmax_segm_max.shape == layer.softmax_segm_expsum.shape == (40, 24, 16)
    assert vt.VllmTritonAttention(8, 8, 64, 1.0, max_num_seqs=4).softmax_segm_max.shape[0] == 4
    with pytest.raises(ValueError, match="multiples of 16"):
        _, k, v = synthetic_caches("classic", 4, 8, 2, 64, 64, torch.float16)
        q = torch.zeros(1, 8, 64, dtype=torch.float16)
        layer = vt.VllmTritonAttention(8, 2, 64, 1.0)
        layer.prepare(q, k, v, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1).int())


@needs_vllm
def test_load_leaves_vllm_name_free():
    module = vt.load()
    assert sys.modules[vt.ALIAS + ".v1.attention.ops.triton_unified_attention"] is module
    assert "vllm" not in sys.modules or sys.modules["vllm"].__file__ != str(
        vt.FOLDER / "vllm" / "__init__.py"
    )


@needs_vllm
def test_fetch_from_a_wheel(tmp_path, monkeypatch):
    """fetch() rebuilds the folder from a wheel and refuses files that are not 0.33.0's."""
    wheel = tmp_path / "vllm-0.33.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name in vt.FILES:
            zf.writestr(name, (vt.FOLDER / name).read_bytes())
    monkeypatch.setattr(vt, "FOLDER", tmp_path / "peer")
    assert vt.fetch(wheel) == tmp_path / "peer" and vt.available()
    bad = tmp_path / "bad.whl"
    with zipfile.ZipFile(bad, "w") as zf:
        for name in vt.FILES:
            zf.writestr(name, "# not vLLM\n")
    with pytest.raises(ValueError, match="sha256"):
        vt.fetch(bad)


def test_missing_folder_names_the_fetch_command(tmp_path, monkeypatch):
    monkeypatch.setattr(vt, "FOLDER", tmp_path / "absent")
    monkeypatch.setattr(vt, "_MODULE", None)
    assert not vt.available()
    with pytest.raises(FileNotFoundError, match="--fetch"):
        vt.load()
