"""Run tests/clients/accelerator_client.py on accel (``python -m tests.clients.run_client``).

The client's source is loaded with ``torch.accelerator``, ``torch.Stream``
and ``torch.Event`` replaced by ``accel``, ``accel.Stream`` and
``accel.Event`` (and ``import accel`` added); nothing else changes. The work
the helpers measure is accel memory and stream work on every backend, plus
torch tensors where torch can reach the device (the host).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np

import accel

SOURCE = Path(__file__).with_name("accelerator_client.py")


def load_client() -> types.ModuleType:
    text = SOURCE.read_text()
    for torch_name, accel_name in (("torch.accelerator", "accel"), ("torch.Stream", "accel.Stream"),
                                   ("torch.Event", "accel.Event")):
        text = text.replace(torch_name, accel_name)
    text = text.replace("import torch\n", "import torch\nimport accel\n", 1)
    module = types.ModuleType("accelerator_client_on_accel")
    exec(compile(text, str(SOURCE), "exec"), module.__dict__)
    return module


def main() -> int:
    client = load_client()
    backend = accel.current_accelerator().type
    assert client.pick_device() == accel.current_accelerator()

    info = client.describe()
    assert info["type"] == backend and info["count"] >= 1 and info["index"] == 0
    assert {"float32", "uint16"} <= info["dtypes"]

    buf = accel.memory.allocate(1 << 20)
    host = np.zeros(1 << 20, dtype=np.uint8)

    def fill_and_copy_back() -> None:
        stream = accel.current_stream()
        stream.fill(buf, 7)
        stream.copy(host, buf)

    assert client.time_ms(fill_and_copy_back) >= 0.0
    accel.synchronize()
    assert host[0] == host[-1] == 7

    blocks, peak = client.peak_memory(lambda: [accel.memory.allocate(1 << 20) for _ in range(3)])
    assert peak >= 3 << 20, peak
    del blocks

    def on_side() -> str:
        accel.current_stream().fill(buf, 9)
        accel.current_stream().copy(host, buf)
        return "queued"

    assert client.run_on_side_stream(on_side) == "queued"
    assert host[0] == host[-1] == 9

    seen = client.on_each_device(lambda: accel.memory.allocate(4096).device)
    assert [index for index, _ in seen] == list(range(accel.device_count()))
    assert [device.index for _, device in seen] == list(range(accel.device_count()))

    report = client.memory_report()
    assert 0 <= report["free"] <= report["total"] and report["allocated"] >= 1 << 20
    assert report["reserved"] >= report["allocated"] and report["peak_reserved"] >= report["reserved"]
    buf.free()
    client.release()
    assert accel.memory.memory_reserved() < report["reserved"]

    if backend == "cpu":  # torch tensors live where accel's host backend runs
        import torch

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        batches = [(torch.randn(32, 8), torch.randn(32, 1)) for _ in range(20)]
        first_batch = batches[:1] * 20
        losses = client.train(model, first_batch)
        assert losses[-1] < losses[0], losses
        assert client.train(model, batches)[0] > 0
        assert client.time_ms(lambda: model(batches[0][0])) >= 0.0
        assert client.run_on_side_stream(lambda: model(batches[0][0])).shape == (32, 1)
    print(f"ok: the torch.accelerator client ran on {backend}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
