"""Python side of bench/ddp.sh: the same tiny BERT (bench/bert_step_torch.py) trained with
torch.nn.parallel.DistributedDataParallel over gloo, 2 processes x 1 thread, micro-batch per
rank as given; prints 'ms_per_step <value>' from rank 0. Debian's /usr/bin/python3 (torch 1.13)."""
import os, sys, time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bert_step_torch as b  # noqa: E402


def worker(rank, world, steps, micro, port):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    c = b.SIZES["tiny"]
    model = b.Bert(c["hidden"], c["layers"], c["heads"], c["inter"])
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-4)
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(1000, b.VOCAB, (micro, b.SEQ), generator=g)
    labels = torch.where(torch.rand(ids.shape, generator=g) < 0.15, ids, torch.full_like(ids, -100))
    am, tt = torch.ones_like(ids), torch.zeros_like(ids)

    def step():
        ddp(ids, am, tt, labels).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if rank == 0:
        print(f"ms_per_step {(time.perf_counter() - t0) * 1000 / steps:.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    steps, micro = int(sys.argv[1]), int(sys.argv[2])
    mp.spawn(worker, args=(2, steps, micro, 29000 + os.getpid() % 1000), nprocs=2)
