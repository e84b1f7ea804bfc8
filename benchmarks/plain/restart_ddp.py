"""Plain torch's checkpoint-restart, the baseline dtk's is measured against: DDP on gloo, a DCP checkpoint every
--every steps, resume from the latest one, under `torchrun --standalone --nproc-per-node 2 --max-restarts 1`.
On attempt 0, rank 1 SIGKILLs itself at the start of --kill-step. Every rank appends its start-up timeline and
step completion times to `--out-dir/rank<R>.jsonl`, so the downtime splits as dtk's report splits it."""
import time

MAIN_AT = time.time()  # before the heavy imports: "process start" vs "import", as dtk's worker splits them

import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

IMPORTED_AT = time.time()

import workload as w  # noqa: E402


def latest_checkpoint(folder: Path) -> tuple[int, Path] | None:
    found = [(int(p.name[5:]), p) for p in folder.glob("step_*") if (p / ".metadata").is_file()]
    return max(found) if found else None


def main() -> None:
    args = w.parse_args({"--every": {"type": int, "default": 10}, "--kill-step": {"type": int, "default": 25},
                         "--out-dir": {"required": True}})
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(args.out_dir)
    log = open(out / f"rank{rank}.jsonl", "a", buffering=1)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # torchrun's agent store outlives the attempts: without a prefix of its own, a restarted rank reads the dead
    # attempt's gloo addresses (8 of 10 restarts failed that way here).
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}", agent_store), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    group_at = time.time()

    model = DistributedDataParallel(w.build_model())
    optimizer = w.build_optimizer(model.parameters())
    engine_at = time.time()
    start = 0
    ckpt_dir = out / "checkpoints"
    if found := latest_checkpoint(ckpt_dir):
        model_sd, optim_sd = get_state_dict(model, optimizer)  # creates Adam's state, so there is one to load into
        state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=str(found[1]))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = int(state["step"])
    log.write(json.dumps({"event": "timeline", "attempt": attempt, "rank": rank, "main_at": MAIN_AT,
                          "imported_at": IMPORTED_AT, "group_at": group_at, "engine_at": engine_at,
                          "loaded_at": time.time(), "start_step": start}) + "\n")

    data = w.SyntheticTokens(vocab_size=w.VOCAB, seq_len=w.SEQ_LEN, seed=w.SEED)
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        if attempt == 0 and rank == 1 and step == args.kill_step:
            (out / "kill.json").write_text(json.dumps({"step": step, "time": time.time()}))
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = data.batch(step=step, rank=rank, micro=0, size=w.MICRO_BATCH)
        loss = w.loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach()
        dist.all_reduce(loss)  # the same per-step exchange dtk makes for its loss record
        log.write(json.dumps({"event": "step", "attempt": attempt, "step": step, "time": time.time(),
                              "seconds": time.perf_counter() - t0, "loss": float(loss) / world}) + "\n")
        if (step + 1) % args.every == 0:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(step + 1)},
                     checkpoint_id=str(ckpt_dir / f"step_{step + 1}"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
