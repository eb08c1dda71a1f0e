"""Child process for test_experience_queue.py, one side of a queue at URL:

- ``write URL NAME BATCHES SIZE``: puts BATCHES batches of SIZE groups (prompt_index = batch * SIZE + j, arrays
  filled with that index), printing ``committed <batch>`` after each commit; ``BATCHES`` 0 = forever.
- ``consume URL FIRST_STEP STEPS N CHECKPOINT_FILE``: for steps FIRST_STEP.. takes N groups per step, prints
  ``step <k> <prompt indices>``, and after every even step writes k to CHECKPOINT_FILE (its "checkpoint").
"""

import sys

import numpy as np

from jrl.explore.queue import ExperienceGroup, open_queue


def group(index: int, name: str) -> ExperienceGroup:
    g, t = 4, 64  # ~4 KB of arrays per group, so a batch's write takes a while
    fill = np.full((g, t), index, np.int32)
    return ExperienceGroup(prompt_ids=np.full(8, index, np.int32), completion_ids=fill, completion_mask=fill,
                           sampling_logprobs=fill.astype(np.float32), truncated=np.zeros(g, bool),
                           rewards=np.full((g, 2), index, np.float32), policy_version=0, explorer=name,
                           prompt_index=index)


def write(url: str, name: str, batches: str, size: str) -> None:
    queue, size = open_queue(url), int(size)
    batch = 0
    while int(batches) == 0 or batch < int(batches):
        queue.put([group(batch * size + j, name) for j in range(size)])
        print(f"committed {batch}", flush=True)
        batch += 1


def consume(url: str, first: str, steps: str, n: str, checkpoint: str) -> None:
    queue = open_queue(url)
    for step in range(int(first), int(first) + int(steps)):
        groups = queue.take(int(n), step=step, timeout=60)
        print(f"step {step} " + " ".join(str(g.prompt_index) for g in groups), flush=True)
        if step % 2 == 0:
            with open(checkpoint, "w") as f:
                f.write(str(step))


if __name__ == "__main__":
    {"write": write, "consume": consume}[sys.argv[1]](*sys.argv[2:])
