"""bfloat16 products widened in registers (rcdl.ops.widen) against float64 products of the
stored numbers, and the attention on that path against the float32-chunk path it replaces
for training batches on CPUs without native bfloat16 (docs/precision.md, "Product paths")."""

import pytest
import torch

from rcdl.ops import half
from rcdl.ops.attention import attention, attention_partial, nearest_sq_distance
from rcdl.ops.half import chunk_products, half_products
from rcdl.ops.kernels import KERNELS, naive_attention

pytestmark = pytest.mark.extra("fast-cpu")


def relative_error(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def store(n, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=gen).bfloat16()


# odd sizes: row tiles of 4 and 8, query groups of 4 and 2 and column blocks of 256 all have
# remainders
@pytest.mark.parametrize(("c", "d", "b"), [(1, 3, 1), (7, 13, 5), (37, 300, 17), (64, 512, 16),
                                           (9, 40, 7)])
def test_the_widened_products_are_float32_products_of_the_stored_numbers(c, d, b):
    from rcdl.ops import widen

    rows = store(c, d)
    gen = torch.Generator().manual_seed(1)
    x, block = torch.randn(b, d, generator=gen), torch.randn(c, b, generator=gen)
    exact = rows.double()  # the stored numbers, exactly
    for queries in (None, 2, 4):  # this CPU's choice, and both ways whatever it is
        out, sqnorm = widen.scores(rows, x, sqnorm=True, queries=queries)
        assert out.dtype == torch.float32 and out.shape == (c, b)
        torch.testing.assert_close(out.double(), exact @ x.double().T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sqnorm.double(), exact.square().sum(1), rtol=1e-5,
                                   atol=1e-5)
    acc = torch.randn(b, d, generator=gen)
    want = acc.double() + 0.5 * block.double().T @ exact
    assert widen.sum_over_entries_(acc, block, rows, 0.5) is acc
    torch.testing.assert_close(acc.double(), want, rtol=1e-5, atol=1e-5)


def test_wrong_operands_are_refused_by_name():
    from rcdl.ops import widen

    with pytest.raises(ValueError, match="contiguous bfloat16 CPU tensor, got torch.float16"):
        widen.scores(torch.zeros(3, 4, dtype=torch.float16), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="float32 CPU tensors, got torch.float64"):
        widen.scores(store(3, 4), torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="queries must be 2 or 4, got 3"):
        widen.scores(store(3, 4), torch.zeros(2, 4), queries=3)


@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_widened_matches_float32_chunks_in_outputs_and_every_gradient(kernel):
    """Training batches: the same answers as the float32-chunk path (both multiply the
    stored numbers in float32; only the order of summation differs), gradients of the
    queries, keys, values and weights (the hybrid trains its entries) included."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(6, 40, generator=gen)
    keys, values = store(203, 40, seed=3), store(203, 7, seed=4)
    weights = torch.rand(203, generator=gen) + 0.1
    grad_out = torch.randn(6, 7, generator=gen)
    got = {}
    for mode in ("float32", "widen"):
        leaves = [t.clone().requires_grad_() for t in (q, keys, values, weights)]
        with half_products(mode):
            out = attention(*leaves, kernel=kernel, chunk_size=64)
        out.backward(grad_out)
        got[mode] = [out.detach()] + [t.grad for t in leaves]
    for name, a, b in zip(["out", "q", "k", "v", "w"], got["widen"], got["float32"],
                          strict=True):
        assert a.dtype == b.dtype, name
        # the entries' gradients are rounded to the store's bfloat16: the two paths' float32
        # gradients (equal to about 1e-6) may round to neighbouring numbers, one ulp apart
        assert relative_error(a, b) < (1e-5 if a.dtype == torch.float32 else 2.0**-7), name
    ref = naive_attention(q.double(), keys.double(), values.double(), weights.double(),
                          kernel=kernel)
    assert relative_error(got["widen"][0], ref) < 1e-5  # float32 products of stored numbers


def test_partials_nearest_distances_and_shares_take_the_widened_path():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(9, 24, generator=gen)
    keys, values = store(150, 24, seed=6), store(150, 5, seed=7)
    weights = torch.rand(150, generator=gen) + 0.1
    with half_products("widen"):
        part = attention_partial(q, keys, values, weights, kernel="rbf", chunk_size=32)
        near = nearest_sq_distance(q, keys, chunk_size=32)
    with half_products("float32"):
        ref_part = attention_partial(q, keys, values, weights, kernel="rbf", chunk_size=32)
    assert relative_error(part.num, ref_part.num) < 1e-5
    exact = torch.cdist(q.double(), keys.double()).amin(1) ** 2
    assert relative_error(near, exact) < 1e-5


def test_the_widened_path_is_for_training_batches_of_bfloat16_stores_on_cpu(monkeypatch):
    """Where it is taken: bfloat16 on a CPU without native products, at most
    WIDEN_MAX_BATCH queries; by ``auto`` only where it measured faster than converting."""
    monkeypatch.setattr(half.PRODUCTS, "_value", "auto")
    monkeypatch.setattr(half, "_cpu_flags", lambda: frozenset({"avx2", "fma"}))
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    for pays, path in ((True, "widen"), (False, "float32")):
        monkeypatch.setattr(half, "widen_pays", lambda pays=pays: pays)
        assert chunk_products(bf16, cpu, 16) == path
        assert chunk_products(bf16, cpu, half.WIDEN_MAX_BATCH + 1) == "float32"
    assert chunk_products(torch.float16, cpu, 16) == "float32"  # bfloat16 only
    assert chunk_products(torch.float32, cpu, 16) == "store"
    assert chunk_products(bf16, torch.device("meta"), 16) == "store"  # a GPU-like device
    with half_products("widen"):
        assert chunk_products(bf16, cpu, 16) == "widen"
        assert chunk_products(bf16, cpu, 500) == "float32"
        from rcdl.ops import widen

        path = half.product_path(bf16, cpu)  # what a run records, with the kernel's choice
        assert path.startswith("widened in registers") and path.endswith("float32 chunks")
        assert f"{widen.queries_per_pass()} queries per score pass" in path
        assert widen.queries_per_pass() == (4 if widen._wide_registers() else 2)
    with half_products("native"):
        assert chunk_products(bf16, cpu, 16) == "store"
    # float64 queries are not widened (the kernels multiply float32)
    keys, values = store(10, 4), store(10, 3)
    with half_products("widen"):
        out = attention(torch.randn(2, 4, dtype=torch.float64), keys, values,
                        torch.ones(10, dtype=torch.float64), kernel="softmax")
    assert out.dtype == torch.float64


def test_widen_pays_measures_both_ways_once_per_thread_count():
    """The timing is kept per thread count: a count set later is timed anew, not answered
    from the first count's timing; asking for another count than the process's is refused."""
    from rcdl.options import set_threads, threads

    before = threads()
    half.widen_pays_at.cache_clear()
    try:
        answer = half.widen_pays()
        assert isinstance(answer, bool)
        assert half.widen_pays() is answer and half.widen_pays_at.cache_info().hits == 1
        set_threads(before + 1)
        half.widen_pays()
        assert half.widen_pays_at.cache_info().misses == 2  # timed at the new count
        with pytest.raises(ValueError, match="set the count first"):
            half.widen_pays_at(before + 5)  # a count not timed yet, not the process's
    finally:
        set_threads(before)


@pytest.mark.spawns
def test_set_threads_sets_torchs_and_numbas_count_once():
    """rcdl.options.set_threads is the one place: numba's pool follows it, whether it started
    before or after, and a widened call leaves both counts as they were set."""
    import subprocess
    import sys

    code = ("import numba, torch\n"
            "from rcdl.options import set_threads\n"
            "from rcdl.ops import widen\n"
            "set_threads(1)\n"
            "widen.scores(torch.randn(5, 8).bfloat16(), torch.randn(3, 8))\n"
            "print(torch.get_num_threads(), numba.get_num_threads())\n"
            "set_threads(2)\n"
            "widen.scores(torch.randn(5, 8).bfloat16(), torch.randn(3, 8))\n"
            "print(torch.get_num_threads(), numba.get_num_threads())\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**__import__("os").environ, "NUMBA_NUM_THREADS": "2"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-4:] == ["1", "1", "2", "2"]


def test_set_threads_refuses_what_is_not_a_count():
    from rcdl.options import set_threads

    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="thread count"):
            set_threads(bad)


@pytest.mark.spawns
def test_starting_numba_leaves_torchs_thread_count_as_it_was():
    """numba's OpenMP pool resets the process's OpenMP thread count as it starts; rcdl puts
    torch's back (a run on one thread stays on one thread, and records one)."""
    import subprocess
    import sys

    code = ("import torch; torch.set_num_threads(1)\n"
            "from rcdl.ops import widen\n"
            "widen.scores(torch.randn(5, 8).bfloat16(), torch.randn(3, 8))\n"
            "print(torch.get_num_threads())\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-1] == "1"


def test_numba_compiles_for_the_class_it_runs_as_with_full_width_vectors(monkeypatch):
    """numba adds the host's features to the CPU name it is given (AVX512 on an AVX2
    Haswell): an emulated class sets both; an AVX512 CPU, real or emulated, gets 512-bit
    vectors; a user's choice of either variable is left alone."""
    import os

    from rcdl.ops import widen

    def target(capability: str, onednn: str | None = None, flags: str = "avx2",
               **user: str) -> tuple:
        for name in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES", "ONEDNN_MAX_CPU_ISA"):
            monkeypatch.delenv(name, raising=False)
        for name, value in user.items():
            monkeypatch.setenv(name, value)
        if onednn is not None:
            monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", onednn)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        monkeypatch.setattr(widen, "cpuinfo_flags", lambda: frozenset(flags.split()))
        widen._numba_target()
        return os.environ.get("NUMBA_CPU_NAME"), os.environ.get("NUMBA_CPU_FEATURES")

    def four_queries(*args: str, **user: str) -> bool:  # the score kernel's choice there
        target(*args, **user)
        return widen._wide_registers()

    avx512 = "avx2 avx512f avx512_bf16"
    assert target("AVX2", flags=avx512) == ("haswell", "")
    assert target("AVX512", "AVX512_CORE", flags=avx512) == ("skylake-avx512", "-prefer-256-bit")
    assert target("AVX2") == (None, None)  # an AVX2 CPU as it is: numba's own choice
    name, features = target("AVX512", flags=avx512)  # this CPU's features, full width
    assert name is None and features.endswith("-prefer-256-bit")
    assert target("AVX512", "AVX512_CORE_BF16", flags=avx512)[0] is None
    assert target("AVX2", flags=avx512, NUMBA_CPU_NAME="znver3") == ("znver3", None)
    assert target("AVX2", flags=avx512, NUMBA_CPU_FEATURES="+avx2") == (None, "+avx2")
    # four queries at a time only where numba's target has AVX512's 32 vector registers
    assert four_queries("AVX512", "AVX512_CORE", flags=avx512)  # skylake-avx512
    assert not four_queries("AVX2", flags=avx512)  # haswell
    assert not four_queries("AVX2")  # an AVX2 CPU as it is
    assert not four_queries("AVX2", flags=avx512, NUMBA_CPU_NAME="znver3")
    # what an AVX512 CPU as it is gets (its own features, full width), and a user's choice
    assert four_queries("AVX2", NUMBA_CPU_FEATURES="+avx2,+avx512f,-prefer-256-bit")
