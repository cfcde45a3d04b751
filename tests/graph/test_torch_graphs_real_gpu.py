"""torch's CUDA graphs carrying accel captures, on a real GPU (``python -m pytest -m gpu``).

Runs in a fresh interpreter with the system's CUDA driver and needs a CUDA
build of torch; it skips otherwise. tests/graph/test_torch_graphs.py covers
the same integration on the simulated driver in every CI run.
"""

from __future__ import annotations

import pytest

from tests.backends.cuda.conftest import run_on_real_gpu

pytestmark = pytest.mark.gpu

SCENARIO = """
import sys
import torch
if not torch.cuda.is_available():
    print("SKIP: torch has no CUDA here (" + str(torch.version.cuda) + ")")
    sys.exit(0)
import accel
from accel.graph import Graph, graph, make_graphed_callables
assert accel.current_accelerator().type == "cuda"

# torch kernels, an accel copy and an accel host function in one graph.
x = torch.zeros(1 << 16, device="cuda")
y = torch.empty_like(x)
ran = []
backend = accel._runtime.get_runtime().backend
start = backend.pending_host_functions()
g = Graph()
with graph(g):
    z = x * 2 + 1                                   # torch kernels, into the graph's pool
    accel.current_stream().copy(y, z)               # accel's stream work, after them
    accel.current_stream().launch_host_func(lambda: ran.append(1))
for value in (1.0, 5.0):
    x.fill_(value)
    torch.cuda.synchronize()
    g.replay()
    accel.synchronize()
    assert torch.equal(y, torch.full_like(x, value * 2 + 1)), (value, y[:4])
assert ran == [1, 1]
# The graph holds the host function and the one keeping the copy's tensors
# alive (2 on the real driver); reset lets every one of them go.
assert backend.pending_host_functions() > start
g.reset()
accel.synchronize()
assert backend.pending_host_functions() == start, (start, backend.pending_host_functions())

# Random ops replay with fresh numbers (torch's generator registration).
r = Graph()
with graph(r):
    noise = torch.rand(1024, device="cuda")
r.replay(); accel.synchronize(); first = noise.clone()
r.replay(); accel.synchronize()
assert not torch.equal(first, noise)
r.reset()

# make_graphed_callables on CUDA: replay matches eager, no host sync needed.
torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda().eval()
fast = make_graphed_callables(mlp, (torch.randn(8, 64, device="cuda"),))
with torch.no_grad():
    for _ in range(3):
        inp = torch.randn(8, 64, device="cuda")
        torch.testing.assert_close(fast(inp), mlp(inp), rtol=0, atol=0)
    # Replays on a created accel stream: the inputs torch copied and the outputs
    # torch reads are ordered by stream waits, with no synchronize anywhere.
    big = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda().eval()
    fast_big = make_graphed_callables(big, (torch.randn(256, 2048, device="cuda"),))
    with accel.Stream():
        for _ in range(5):
            inp = torch.randn(256, 2048, device="cuda")
            torch.testing.assert_close(fast_big(inp), big(inp), rtol=0, atol=0)

# A graph of torch kernels alone replays with no host function: a forwarder of
# host-function failures per replay made graphed calls 2.5x slower than torch's.
queued = []
launch = backend.launch_host_func
backend.launch_host_func = lambda *args: (queued.append(args), launch(*args))
with torch.no_grad():  # graphed calls are inference-only: in grad mode they are refused
    for _ in range(3):
        fast(torch.randn(8, 64, device="cuda"))
torch.cuda.synchronize()
del backend.launch_host_func
assert queued == [], queued
print("OK")
"""

EXIT = """
import sys
import torch
if not torch.cuda.is_available():
    print("SKIP: torch has no CUDA here")
    sys.exit(0)
import accel
from accel.graph import make_graphed_callables
torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 128), torch.nn.GELU(),
                          torch.nn.Linear(128, 10)).eval().cuda()
x = torch.randn(1, 64, device="cuda")
fast = make_graphed_callables(mlp, (x,))
with torch.no_grad():
    fast(x)
torch.cuda.synchronize()
# torch's own graphed callables of the same model, after accel's: their warm-up
# backward must not record gradients on accel's capture stream. (An autograd
# graph captured by accel bound the parameters' AccumulateGrad nodes to it, and
# torch aborted at exit: "CUDA error: context is destroyed" in insert_events.)
trained = torch.cuda.make_graphed_callables(mlp, (x.clone(),))
torch.cuda.synchronize()
print("OK")
"""


def test_torch_cuda_graph_carries_accel_capture() -> None:
    run_on_real_gpu(SCENARIO)


def test_training_after_graphing_exits_cleanly() -> None:
    run_on_real_gpu(EXIT)


DEMO = """
import json, subprocess, sys
import torch
if not torch.cuda.is_available():
    print("SKIP: torch has no CUDA here")
    sys.exit(0)
out = subprocess.run([sys.executable, "-m", "accel", "demo", "--json", "--calls", "50"],
                     capture_output=True, text=True, check=True).stdout
report = json.loads(out)
assert report["backend"] == "cuda" and "torch's graphs" in report["workload"], report
assert report["torch_graph"]["allocations_during_replays"] == 0, report
assert report["torch_graph"]["max_abs_error"] < 1e-5, report
print(json.dumps(report))
print("OK")
"""


def test_demo_replays_a_torch_model_through_torch_cuda_graphs() -> None:
    run_on_real_gpu(DEMO)
