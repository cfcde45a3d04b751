"""Device-agnostic helpers written for ``torch.accelerator``, as users write them.

The patterns follow PyTorch's accelerator documentation and tutorials: pick
the accelerator or fall back on the CPU, time with events, measure peak
memory, overlap work on a side stream, visit every device, report memory, and
a small training loop. tests/test_real_clients.py runs this file with
``torch.accelerator`` / ``torch.Stream`` / ``torch.Event`` replaced by accel's
and nothing else changed.
"""

import torch


def pick_device():
    # https://docs.pytorch.org/docs/stable/accelerator.html
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator()
    return torch.device("cpu")


def describe():
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return {
        "type": accelerator.type,
        "count": torch.accelerator.device_count(),
        "index": torch.accelerator.current_device_index(),
        "dtypes": torch.accelerator.get_device_capability()["supported_dtypes"],
    }


def time_ms(fn, iters=5):
    start = torch.Event(enable_timing=True)
    end = torch.Event(enable_timing=True)
    fn()  # warm-up
    torch.accelerator.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def peak_memory(fn):
    torch.accelerator.synchronize()
    torch.accelerator.reset_peak_memory_stats()
    base = torch.accelerator.memory_allocated()
    result = fn()
    torch.accelerator.synchronize()
    return result, torch.accelerator.max_memory_allocated() - base


def run_on_side_stream(fn):
    main = torch.accelerator.current_stream()
    side = torch.Stream(torch.accelerator.current_accelerator())
    side.wait_stream(main)
    with side:
        out = fn()
    main.wait_stream(side)
    done = torch.Event()
    done.record(main)
    done.synchronize()
    return out


def on_each_device(fn):
    results = []
    for index in range(torch.accelerator.device_count()):
        with torch.accelerator.device_index(index):
            results.append((torch.accelerator.current_device_index(), fn()))
    return results


def memory_report():
    free, total = torch.accelerator.get_memory_info()
    stats = torch.accelerator.memory_stats()
    return {
        "free": free,
        "total": total,
        "allocated": stats["allocated_bytes.all.current"],
        "reserved": torch.accelerator.memory_reserved(),
        "peak_reserved": torch.accelerator.max_memory_reserved(),
    }


def release():
    torch.accelerator.synchronize()
    torch.accelerator.empty_cache()
    torch.accelerator.empty_host_cache()
    torch.accelerator.reset_accumulated_memory_stats()


def train(model, batches):
    device = pick_device()
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    torch.accelerator.synchronize(device)
    return losses
