"""Runs allreduces in a loop until the job is killed, recording a Horovod timeline.

usage: timeline_kill.py env|dynamic|hang PATH
  env:     the timeline was asked for with HOROVOD_TIMELINE=PATH (the test sets it)
  dynamic: hvd.start_timeline(PATH, mark_cycles=True) at run time
  hang:    as env, but after 10 steps (each an allreduce named step.N) the last rank stops
           (as if stuck in its own code) while rank 0 waits in an allreduce it never joins

Each step is a fused batch of four named allreduces plus one lone one. The test reads the
file while the job runs and then kills the whole job with SIGKILL."""
import sys
import time

import numpy as np

import hvd_magic.collectives as hvd

mode, path = sys.argv[1], sys.argv[2]
hvd.init()
if mode == "dynamic":
    hvd.start_timeline(path, mark_cycles=True)
r = hvd.rank()
if mode == "hang":
    for step in range(10):
        hvd.allreduce(np.ones(8, np.float32), name=f"step.{step}")
    if r == hvd.size() - 1:
        time.sleep(300)                      # the test kills the job long before this
    hvd.allreduce(np.ones(8, np.float32), name="never joined")
    sys.exit(1)
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
