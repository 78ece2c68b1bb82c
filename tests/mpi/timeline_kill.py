"""Runs allreduces in a loop until the job is killed, recording a Horovod timeline.

usage: timeline_kill.py env|dynamic PATH
  env:     the timeline was asked for with HOROVOD_TIMELINE=PATH (the test sets it)
  dynamic: hvd.start_timeline(PATH, mark_cycles=True) at run time

Each step is a fused batch of four named allreduces plus one lone one. Rank 0 prints
"looping" once the loop runs; the test then reads the file while the job runs and kills
the whole job with SIGKILL."""
import sys
import time

import numpy as np

import hvd_magic.collectives as hvd

mode, path = sys.argv[1], sys.argv[2]
hvd.init()
if mode == "dynamic":
    hvd.start_timeline(path, mark_cycles=True)
r = hvd.rank()
step = 0
deadline = time.monotonic() + 300      # the test kills the job long before this
while time.monotonic() < deadline:
    hs = [hvd.allreduce_async(np.full(256, float(r + i), np.float32), name=f"grad.{i}", op=hvd.Sum)
          for i in range(4)]
    for h in hs:
        hvd.synchronize(h)
    hvd.allreduce(np.ones(8, np.float32), name="loss")
    step += 1
    if step == 20 and r == 0:
        print("looping", flush=True)
    time.sleep(0.002)     # a training step's compute
print("timeline_kill: was not killed", flush=True)
sys.exit(1)
