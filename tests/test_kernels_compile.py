"""NVRTC compiles kernels/kv_copy.cu without a GPU: CI catches a kernel that does not build."""
from __future__ import annotations

from functools import cache

import pytest
from conftest import script_module

pytest.importorskip("cuda.core")


@pytest.fixture(scope="module")
def cuda_ops():
    try:
        from cuda.bindings import nvrtc

        nvrtc.nvrtcVersion()
    except Exception as e:  # the nvrtc extra is not installed
        pytest.skip(f"NVRTC unavailable: {e}")
    from kvlab.memory.ops import cuda

    return cuda


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compiles_to_cubin(cuda_ops, arch):
    cubin = cuda_ops.compile_for_arch(arch, use_cache=False)
    assert cubin[:4] == b"\x7fELF"
    assert b"kv_pack" in cubin and b"kv_unpack" in cubin


TUNINGS = [dict(), dict(threads=512, unroll=16), dict(threads=128, bulk=True)]


@pytest.fixture(scope="module")
def verbose_build(cuda_ops):
    """The sm_90 cubin and ptxas's report for a tuning, compiled once for all the tests that read them."""
    import io

    from cuda.core import Program

    @cache
    def build(**tuning) -> tuple[bytes, str]:
        opts = cuda_ops._options("sm_90", cuda_ops.Tuning(**tuning))
        opts.ptxas_options = "-v"
        log = io.StringIO()
        cubin = bytes(Program(cuda_ops._source(), "c++", options=opts).compile("cubin", logs=log).code)
        return cubin, log.getvalue().replace("\0", "")

    return build


def test_tunings_compile(verbose_build):
    """Each tuning reaches the compiler: a cubin of its own, not the default's bytes again."""
    cubins = [verbose_build(**t)[0] for t in TUNINGS]
    assert all(c[:4] == b"\x7fELF" for c in cubins)
    assert len(set(cubins)) == len(TUNINGS)


def test_disk_cache(cuda_ops, tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path))
    first = cuda_ops.compile_for_arch("sm_90")
    files = list(tmp_path.glob("kv_copy-sm_90-*.cubin"))
    assert len(files) == 1 and files[0].read_bytes() == first
    # a different tuning is a different cubin, never a stale hit
    cuda_ops.compile_for_arch("sm_90", cuda_ops.Tuning(unroll=4))
    assert len(list(tmp_path.glob("kv_copy-sm_90-*.cubin"))) == 2
    files[0].write_bytes(b"\x7fELFcached")
    assert cuda_ops.compile_for_arch("sm_90") == b"\x7fELFcached"


def test_bad_tuning_rejected(cuda_ops):
    # the message names the field, the value and what would work
    with pytest.raises(ValueError, match=r"Tuning\.threads=100: use a multiple of 32 in \[32, 1024\]"):
        cuda_ops.Tuning(threads=100)
    with pytest.raises(ValueError, match=r"Tuning\.unroll=0: must be >= 1"):
        cuda_ops.Tuning(unroll=0)
    with pytest.raises(ValueError, match=r"Tuning\.piece=100: use a multiple of 16"):
        cuda_ops.Tuning(bulk=True, piece=100)


@pytest.mark.parametrize("tuning", TUNINGS)
def test_no_register_spills(verbose_build, tuning):
    """A spill turns every vector in flight into a local-memory round trip: the copy kernels must fit in registers."""
    _, text = verbose_build(**tuning)
    spills = [line for line in text.splitlines() if "spill" in line]
    assert len(spills) >= 4, f"no ptxas report in the NVRTC log:\n{text}"
    assert all(" 0 bytes spill stores, 0 bytes spill loads" in line for line in spills), text


@pytest.mark.parametrize("tuning", [dict(threads=256, unroll=8), dict(threads=512, unroll=4),
                                    dict(threads=64, unroll=1)])
def test_rect_copy_compiles_without_spills(cuda_ops, tuning):
    """kernels/run_copy.cu (transport=ipc's copy) builds for sm_90 in every tuning the benchmark tries, in registers."""
    import io

    from cuda.core import Program

    opts = cuda_ops._options("sm_90", cuda_ops.Tuning(**tuning), "run_copy")
    opts.ptxas_options = "-v"
    log = io.StringIO()
    src = cuda_ops._source(cuda_ops.RUN_COPY_SOURCE)
    cubin = bytes(Program(src, "c++", options=opts).compile("cubin", logs=log).code)
    assert cubin[:4] == b"\x7fELF" and b"kv_copy_rect" in cubin and b"kv_copy_span" in cubin
    spills = [line for line in log.getvalue().replace("\0", "").splitlines() if "spill" in line]
    assert spills and all(" 0 bytes spill stores, 0 bytes spill loads" in line for line in spills), log.getvalue()


@pytest.mark.parametrize("arch,rows,ring", [("sm_80", 4, 4), ("sm_90", 4, 4), ("sm_90", 2, 4), ("sm_90", 4, 0),
                                            ("sm_90", 8, 0)])
def test_fp8_rows_compiles_without_spills(cuda_ops, arch, rows, ring):
    """kernels/fp8_rows.cu (the GPU's bf16 -> fp8 rows) builds where the copy kernels do, in registers, at the
    rows in flight and cp.async rings the bench compares (scripts/rect_bench.py --convert-rows/--convert-ring)."""
    import io

    from cuda.core import Program

    opts = cuda_ops._options(arch, cuda_ops.ConvertTuning(rows=rows, ring=ring), "fp8_rows")
    opts.ptxas_options = "-v"
    log = io.StringIO()
    cubin = bytes(Program(cuda_ops._source(cuda_ops.FP8_ROWS_SOURCE), "c++", options=opts)
                  .compile("cubin", logs=log).code)
    assert cubin[:4] == b"\x7fELF" and b"kv_quantize_rows" in cubin
    # a kernel per team size and base dtype (kvlab.memory.ops.cuda._convert_kernel picks it by name)
    assert all(f"kv_convert_rect_{lanes}_{base}".encode() in cubin for lanes in (1, 2, 4, 8, 16, 32)
               for base in ("bf16", "fp16"))
    spills = [line for line in log.getvalue().replace("\0", "").splitlines() if "spill" in line]
    assert spills and all(" 0 bytes spill stores, 0 bytes spill loads" in line for line in spills), log.getvalue()




def test_the_benches_ceiling_kernels_compile(cuda_ops):
    """scripts/kernel_ceilings.py's plainest copies, the ceilings the benches time beside kvlab's kernels, build."""
    kc = script_module("kernel_ceilings")
    for source, name in ((kc.LINEAR_SRC, "lin_copy"), (kc.PIECES_SRC, "piece_copy"), (kc.SHRINK_SRC, "shrink_copy"),
                         (kc.PIECE_SHRINK_SRC, "piece_shrink")):
        cubin = bytes(kc.compiled(source, name, "sm_90", 8).code)
        assert cubin[:4] == b"\x7fELF" and name.encode() in cubin


@pytest.mark.gpu
@pytest.mark.parametrize("source, delivered", [(256 * 4100, 132 * 4100), (1152 * 999, 656 * 999), (64, 32), (48, 48)])
def test_the_converting_ceiling_writes_what_its_reference_does(cuda_ops, source, delivered):
    """The fp8 ceiling reads every source byte and writes every delivered one: its bytes are the torch reference's
    (Llama's and DeepSeek-V3.2's row ratios, the halving and the equal ends; the output starts poisoned)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    kc = script_module("kernel_ceilings")
    src = torch.randint(0, 256, (source,), dtype=torch.uint8, device="cuda")
    for unroll in kc.SHRINK_UNROLLS:  # every tuning the benches time
        dst = torch.full((delivered,), 0xA5, dtype=torch.uint8, device="cuda")
        kc.launch_shrink(kc.shrink_copy(cuda_ops.device_arch(0), unroll), src, dst)
        assert torch.equal(dst, kc.shrink_reference(src, delivered)), unroll
    with pytest.raises(ValueError, match="between one and two times"):
        kc.launch_shrink(None, src, dst[:delivered // 4 // 16 * 16])


@pytest.mark.parametrize("n, run", [(64, 16), (96, 32), (7, 1), (16, 16)])
def test_a_sides_runs_lie_whole_at_random_places(n, run):
    """The scattered converting ceiling's places: a permutation of the pieces in which each run's pieces are
    neighbours in order, from a run's first slot; a run that does not divide the pieces is refused."""
    import torch

    kc = script_module("kernel_ceilings")
    at = kc.run_places(n, run, torch.Generator().manual_seed(n))
    assert at.dtype == torch.int32 and sorted(at.tolist()) == list(range(n))
    starts = at.view(-1, run)
    assert (starts[:, 0] % run == 0).all() and (starts - starts[:, :1] == torch.arange(run)).all()
    with pytest.raises(ValueError, match="runs of 5"):
        kc.run_places(12, 5, torch.Generator())


def test_the_scattered_ceilings_reference_is_the_converting_ceilings_per_piece():
    """Each delivered piece of ``piece_shrink_reference`` is ``shrink_reference`` of its source piece, at its own
    place (DeepSeek-V3.2's 1,152 -> 656 bytes, source runs of 16 rows, delivered rows one by one)."""
    import torch

    kc = script_module("kernel_ceilings")
    g = torch.Generator().manual_seed(3)
    src = torch.randint(0, 256, (1152 * 48,), dtype=torch.uint8, generator=g)
    ps, pd = kc.run_places(48, 16, g), kc.run_places(48, 1, g)
    got = kc.piece_shrink_reference(src, ps, pd, 1152, 656).view(48, 656)
    for i in range(48):
        assert torch.equal(got[pd[i]], kc.shrink_reference(src.view(48, 1152)[ps[i]].clone(), 656)), i


@pytest.mark.gpu
@pytest.mark.parametrize("pieces, runs", [((1152, 656), (16, 1)), ((1152, 656), (16, 32)), ((256, 128), (1, 1)),
                                          ((48, 48), (4, 2))])
def test_the_scattered_converting_ceiling_writes_what_its_reference_does(cuda_ops, pieces, runs):
    """``piece_shrink`` on the GPU writes the torch reference's bytes for every tuning the bench times (the output
    starts poisoned); pieces that are not whole vectors, or a source over twice the delivered piece, are refused."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    kc = script_module("kernel_ceilings")
    n = 4 * 96
    g = torch.Generator().manual_seed(5)
    ps, pd = (kc.run_places(n, r, g).cuda() for r in runs)
    src = torch.randint(0, 256, (n * pieces[0],), dtype=torch.uint8, device="cuda")
    want = kc.piece_shrink_reference(src, ps, pd, *pieces)
    for unroll in kc.SHRINK_UNROLLS:
        dst = torch.full((n * pieces[1],), 0xA5, dtype=torch.uint8, device="cuda")
        kc.launch_piece_shrink(kc.piece_shrink(cuda_ops.device_arch(0), unroll), src, dst, ps, pd, *pieces)
        assert torch.equal(dst, want), unroll
    for bad in ((1152, 520), (1328, 656)):
        with pytest.raises(ValueError, match="between one and two times|whole 16-byte"):
            kc.launch_piece_shrink(None, src, dst, ps, pd, *bad)
