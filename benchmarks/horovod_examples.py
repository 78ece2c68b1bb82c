"""Run Horovod's example scripts against hvd_magic under ``hvdrun -np 2``, only the import changed.

    .venv/bin/python benchmarks/horovod_examples.py --horovod-src /tmp/hvdsrc --group pytorch
    .venv/bin/python benchmarks/horovod_examples.py --horovod-src /tmp/hvdsrc --group mxnet \\
        --python .venv-mxnet/bin/python

The scripts are read, unedited, from a Horovod checkout or export (``--horovod-src``, default
``$HOROVOD_SRC``; ``git archive HEAD examples test/parallel test/utils | tar -x`` is enough).
``import horovod.torch as hvd`` (and the TensorFlow/Keras names) reaches hvd_magic's faces
through horovod_suite.py's shim package, written into a temporary directory that goes first
on PYTHONPATH. Each script runs as ``flock /tmp/mpi.lock timeout T hvdrun -np N python
SCRIPT ARGS`` in its own empty working directory, with HOME set to a temporary home; ARGS come
from the EXAMPLES table below and only shorten the run (epochs, iterations, batch sizes) or
point at the generated data. No network is used. What is replaced, and nothing else:

* ``torchvision`` (not installed here) by a stand-in package in the shim directory:
  ``datasets.MNIST`` reads generated 28x28 digits (below) and ignores ``root``/``download``;
  ``datasets.ImageFolder`` is a real folder reader (PIL) over generated PNG folders;
  ``transforms`` has Compose, ToTensor, Normalize, Resize, CenterCrop, RandomResizedCrop and
  RandomHorizontalFlip; ``models.resnet50`` is the ResNet-50 architecture (bottleneck blocks
  3-4-6-3, 25.6M parameters), randomly initialised. Any other torchvision name is missing.
* ``torch.utils.tensorboard``, only when the ``tensorboard`` package is not installed: a
  ``SummaryWriter`` stand-in that appends ``add_scalar`` calls to ``LOG_DIR/scalars.csv``.
* Keras's MNIST download: ``keras.datasets.mnist.load_data`` (also reached as
  ``tf.keras.datasets.mnist``) gets the generated file ``$HOME/.keras/datasets/mnist.npz``
  from its ``get_file`` step, whatever file name the script asks for (Keras would otherwise
  reject the file for its hash and download it).
* The data: MNIST-shaped uint8 images whose label decides where a bright 6x6 block sits
  (learnable, so losses fall), 640 train and 160 test images; ImageNet-shaped folders of
  2 classes with 64x64 RGB PNGs, 4 per class for train and 2 per class for validation.

* The length of the two TF2 MNIST scripts, which no argument sets (5000 steps of a convnet
  at batch 128, and 24 epochs of 250 steps: 35 to 50 minutes each at 0.4 s a step on a
  2-core machine): for the scripts in MAX_STEPS, ``tf.data.Dataset.take(n)`` gives at most
  that many elements and Keras 2's ``fit(steps_per_epoch=n)`` runs at most that many steps an
  epoch (``HVD_EXAMPLES_MAX_STEPS``, read by the hook). Every step, epoch and callback still
  runs as written; there are fewer steps.

The TensorFlow 2 and Keras groups run with ``TF_USE_LEGACY_KERAS=1`` (``pip install
tf-keras``), as a Horovod user on TF >= 2.16 runs them: the scripts are Keras 2 code
(``opt.variables()``, ``compile(experimental_run_tf_function=False)``), and ``tf.keras`` is
then Keras 2, which hvd_magic's Keras face follows. The Keras group's scripts are older
still (TF1's ``tf.ConfigProto``/``tf.Session``, standalone Keras 2's ``ImageDataGenerator``
and ``fit_generator``): they stop at those lines on TensorFlow 2.21 before any Horovod call
that matters, as Horovod's own run does, and are listed with that reason.

These hooks live in a ``sitecustomize.py`` in the shim directory. A script passes when
``hvdrun`` exits 0 and the output has the script's end marker (its last print); a run past
``--timeout`` is a hang. Scripts that cannot run here are listed with the reason.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from horovod_suite import LOCK, shim_env, write_shim  # noqa: E402

HVDRUN = str(Path(sys.executable).with_name("hvdrun"))
# Horovod's TF2 and Keras examples are Keras 2 code (opt.variables(), compile(
# experimental_run_tf_function=...)): run as a Horovod user on TF >= 2.16 runs them, with
# tf-keras installed and TF_USE_LEGACY_KERAS=1, so that tf.keras is Keras 2
LEGACY_KERAS_GROUPS = ("tensorflow2", "keras")
# Scripts whose length no argument sets, cut to this many steps by the harness (see the
# docstring): every step as written, fewer of them (0.4 s a step on this 2-core machine)
MAX_STEPS = {"examples/tensorflow2/tensorflow2_mnist.py": 100,              # of 5000
             "examples/tensorflow2/tensorflow2_keras_mnist.py": 5}          # per epoch, of 250
MNIST_TRAIN, MNIST_TEST = 640, 160
# script [variant] -> (group, args, end marker regex or None, reason it cannot run here or
# None); @DATA@ and @WORK@ in args become the generated-data and working directories.
EXAMPLES = {
    "examples/pytorch/pytorch_mnist.py": (
        "pytorch", ["--epochs", "1", "--batch-size", "32", "--test-batch-size", "80",
                    "--log-interval", "5", "--data-dir", "@DATA@/mnist"], r"Test set: Average loss", None),
    "examples/pytorch/pytorch_synthetic_benchmark.py": (
        "pytorch", ["--batch-size", "2", "--num-warmup-batches", "1", "--num-batches-per-iter", "1",
                    "--num-iters", "2"], r"Total img/sec on 2 CPU", None),
    "examples/pytorch/pytorch_imagenet_resnet50.py": (
        "pytorch", ["--train-dir", "@DATA@/imagenet/train", "--val-dir", "@DATA@/imagenet/val",
                    "--log-dir", "@WORK@/logs", "--checkpoint-format", "@WORK@/checkpoint-{epoch}.pth.tar",
                    "--epochs", "1", "--batch-size", "2", "--val-batch-size", "2"],
        r"Validate Epoch  #1", None),
    "examples/pytorch/pytorch_mnist.py [adasum, fp16]": (
        "pytorch", ["--epochs", "1", "--batch-size", "32", "--test-batch-size", "80", "--use-adasum",
                    "--fp16-allreduce", "--data-dir", "@DATA@/mnist"], r"Test set: Average loss", None),
    "examples/pytorch/pytorch_imagenet_resnet50.py [2 batches per allreduce]": (
        "pytorch", ["--train-dir", "@DATA@/imagenet/train", "--val-dir", "@DATA@/imagenet/val",
                    "--log-dir", "@WORK@/logs", "--checkpoint-format", "@WORK@/checkpoint-{epoch}.pth.tar",
                    "--epochs", "1", "--batch-size", "1", "--val-batch-size", "2",
                    "--batches-per-allreduce", "2"], r"Validate Epoch  #1", None),
    "examples/pytorch/pytorch_lightning_mnist.py": (
        "pytorch", [], None,
        "needs PyTorch Lightning 1.x (Trainer(accelerator='horovod', gpus=...), "
        "validation_epoch_end): Lightning 2 removed its Horovod strategy and those names, so "
        "the current pytorch-lightning cannot run it; Lightning 1.x is not installed here"),
    "examples/tensorflow2/tensorflow2_mnist.py": ("tensorflow2", [], r"Step #90\b", None),
    "examples/tensorflow2/tensorflow2_keras_mnist.py": ("tensorflow2", [], r"Epoch 24/24", None),
    "examples/tensorflow2/tensorflow2_synthetic_benchmark.py": (
        "tensorflow2", ["--batch-size", "2", "--num-warmup-batches", "1", "--num-batches-per-iter",
                        "1", "--num-iters", "2", "--no-cuda"], r"Total img/sec on 2 CPU", None),
    "examples/tensorflow2/tensorflow2_keras_synthetic_benchmark.py": (
        "tensorflow2", ["--batch-size", "2", "--num-batches-per-iter", "1", "--num-iters", "2",
                        "--no-cuda"], r"Total img/sec on 2 CPU", None),
    "examples/tensorflow2/tensorflow2_mnist_data_service.py": (
        "tensorflow2", [], None, "needs Horovod's tf.data service on Spark/Ray "
        "(horovod.tensorflow.data.compute_service, horovod.runner), not part of the faces"),
    # The Keras group is TF1-era code: it stops on TensorFlow 2.21 at a line of the script
    # itself, right after hvd.init(), as Horovod 0.28's own run does (checked: the names are
    # missing from TensorFlow/Keras 3 with or without Horovod)
    "examples/keras/keras_mnist.py": (
        "keras", [], None, "TF1 code: tf.ConfigProto()/tf.Session (line 15, right after hvd.init()) "
        "are gone from TensorFlow 2's top level (tf.compat.v1 only); Horovod 0.28 fails at the same "
        "line on TF 2.21"),
    "examples/keras/keras_mnist_advanced.py": (
        "keras", ["--epochs", "2", "--batch-size", "32"], None,
        "imports keras.preprocessing.image.ImageDataGenerator (line 8), which Keras 3 removed "
        "(TF 2.21's `import keras` is Keras 3 even with TF_USE_LEGACY_KERAS=1), then TF1's "
        "tf.ConfigProto (line 28) and Model.fit_generator; Horovod 0.28 fails at the same import"),
    "examples/keras/keras_imagenet_resnet50.py": (
        "keras", ["--train-dir", "@DATA@/imagenet/train", "--val-dir", "@DATA@/imagenet/val",
                  "--log-dir", "@WORK@/logs", "--checkpoint-format", "@WORK@/checkpoint-{epoch}.h5",
                  "--epochs", "1", "--batch-size", "2", "--val-batch-size", "2"], None,
        "TF1 code: tf.ConfigProto()/tf.Session (line 57, right after hvd.init()), then Keras 2's "
        "ImageDataGenerator and Model.fit_generator, all gone from TF 2.21 / Keras 3; Horovod 0.28 "
        "fails at the same line"),
    # MXNet runs in .venv-mxnet (numpy<1.24): --python .venv-mxnet/bin/python --group mxnet
    "examples/mxnet/mxnet_mnist.py": (
        "mxnet", ["--epochs", "3", "--batch-size", "32", "--no-cuda"], r"Validation: accuracy=", None),
    "examples/mxnet/mxnet_mnist.py [fp16, predivide 2]": (
        "mxnet", ["--epochs", "3", "--batch-size", "32", "--no-cuda", "--fp16-allreduce",
                  "--gradient-predivide-factor", "2"], r"Validation: accuracy=", None),
    "examples/mxnet/mxnet2_mnist.py": (
        "mxnet", [], None, "MXNet 2.x code (mx.np, gluon.metric); MXNet 2 was never released "
        "on PyPI, 1.9.1 is supported here"),
    "examples/mxnet/mxnet_imagenet_resnet50.py": (
        "mxnet", [], None, "reads ImageNet RecordIO files (mx.io.ImageRecordIter) and gluoncv's "
        "model zoo, neither of which is here"),
}

STANDINS = {
    "torchvision/__init__.py": '''
        """Stand-in for torchvision (see benchmarks/horovod_examples.py): generated data only."""
        from . import datasets, models, transforms  # noqa: F401
        __version__ = "0.0+hvd_magic_examples"
        ''',
    "torchvision/transforms.py": '''
        import math, random
        import numpy as np, torch
        from PIL import Image

        class Compose:
            def __init__(self, transforms): self.transforms = list(transforms)
            def __call__(self, x):
                for t in self.transforms: x = t(x)
                return x

        class ToTensor:
            def __call__(self, img):
                a = np.asarray(img, dtype=np.float32) / 255.0
                a = a[None] if a.ndim == 2 else a.transpose(2, 0, 1)
                return torch.from_numpy(np.ascontiguousarray(a))

        class Normalize:
            def __init__(self, mean, std): self.mean, self.std = mean, std
            def __call__(self, t):
                m = torch.tensor(self.mean, dtype=t.dtype)[:, None, None]
                return (t - m) / torch.tensor(self.std, dtype=t.dtype)[:, None, None]

        def _pair(size): return (size, size) if isinstance(size, int) else tuple(size)

        class Resize:
            def __init__(self, size): self.size = size
            def __call__(self, img):
                if not isinstance(self.size, int):
                    return img.resize(self.size[::-1], Image.BILINEAR)
                w, h = img.size; s = self.size / min(w, h)
                return img.resize((max(1, round(w * s)), max(1, round(h * s))), Image.BILINEAR)

        class CenterCrop:
            def __init__(self, size): self.size = _pair(size)
            def __call__(self, img):
                (th, tw), (w, h) = self.size, img.size
                left, top = (w - tw) // 2, (h - th) // 2
                return img.crop((left, top, left + tw, top + th))

        class RandomResizedCrop:
            def __init__(self, size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
                self.size, self.scale, self.ratio = _pair(size), scale, ratio
            def __call__(self, img):
                w, h = img.size
                for _ in range(10):
                    area = w * h * random.uniform(*self.scale)
                    r = math.exp(random.uniform(*map(math.log, self.ratio)))
                    cw, ch = round(math.sqrt(area * r)), round(math.sqrt(area / r))
                    if 0 < cw <= w and 0 < ch <= h:
                        x, y = random.randint(0, w - cw), random.randint(0, h - ch)
                        return img.crop((x, y, x + cw, y + ch)).resize(self.size[::-1], Image.BILINEAR)
                return CenterCrop(min(w, h))(img).resize(self.size[::-1], Image.BILINEAR)

        class RandomHorizontalFlip:
            def __init__(self, p=0.5): self.p = p
            def __call__(self, img):
                return img.transpose(Image.FLIP_LEFT_RIGHT) if random.random() < self.p else img
        ''',
    "torchvision/datasets.py": '''
        import os
        import numpy as np, torch
        from PIL import Image
        _MNIST = @MNIST@

        class MNIST(torch.utils.data.Dataset):
            """Generated digits from the harness's mnist.npz; root and download are ignored."""
            def __init__(self, root, train=True, transform=None, target_transform=None, download=False):
                with np.load(_MNIST) as f:
                    part = "train" if train else "test"
                    self.data, self.targets = f[f"x_{part}"], torch.from_numpy(f[f"y_{part}"].astype(np.int64))
                self.transform, self.target_transform = transform, target_transform
            def __len__(self): return len(self.data)
            def __getitem__(self, i):
                img, target = Image.fromarray(self.data[i], mode="L"), int(self.targets[i])
                if self.transform is not None: img = self.transform(img)
                if self.target_transform is not None: target = self.target_transform(target)
                return img, target

        class ImageFolder(torch.utils.data.Dataset):
            """root/<class>/<image>: classes in sorted order, images read with PIL as RGB."""
            def __init__(self, root, transform=None, target_transform=None):
                self.classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
                self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
                self.samples = [(os.path.join(root, c, n), i) for c, i in self.class_to_idx.items()
                                for n in sorted(os.listdir(os.path.join(root, c)))]
                self.targets = [t for _, t in self.samples]
                self.transform, self.target_transform = transform, target_transform
            def __len__(self): return len(self.samples)
            def __getitem__(self, i):
                path, target = self.samples[i]
                with Image.open(path) as f: img = f.convert("RGB")
                if self.transform is not None: img = self.transform(img)
                if self.target_transform is not None: target = self.target_transform(target)
                return img, target
        ''',
    "torchvision/models.py": '''
        import torch.nn as nn

        class _Bottleneck(nn.Module):
            def __init__(self, cin, width, stride):
                super().__init__()
                cout = 4 * width
                self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
                self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
                self.bn2 = nn.BatchNorm2d(width)
                self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
                self.relu = nn.ReLU(inplace=True)
                self.downsample = None if stride == 1 and cin == cout else nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            def forward(self, x):
                skip = x if self.downsample is None else self.downsample(x)
                y = self.relu(self.bn1(self.conv1(x)))
                y = self.relu(self.bn2(self.conv2(y)))
                return self.relu(self.bn3(self.conv3(y)) + skip)

        class ResNet(nn.Module):
            def __init__(self, blocks, num_classes=1000):
                super().__init__()
                self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
                self.bn1, self.relu = nn.BatchNorm2d(64), nn.ReLU(inplace=True)
                self.maxpool = nn.MaxPool2d(3, 2, 1)
                cin, stages = 64, []
                for width, n, stride in zip((64, 128, 256, 512), blocks, (1, 2, 2, 2)):
                    stage = []
                    for j in range(n):
                        stage.append(_Bottleneck(cin, width, stride if j == 0 else 1))
                        cin = 4 * width
                    stages.append(nn.Sequential(*stage))
                self.layer1, self.layer2, self.layer3, self.layer4 = stages
                self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(cin, num_classes)
            def forward(self, x):
                x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
                x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
                return self.fc(self.avgpool(x).flatten(1))

        def resnet50(num_classes=1000, **kwargs):
            return ResNet((3, 4, 6, 3), num_classes)
        ''',
    "sitecustomize.py": '''
        """Examples harness hooks (see benchmarks/horovod_examples.py)."""
        import importlib.abc, importlib.util, os, sys, types
        _MNIST = @MNIST@

        class _Wrap(importlib.abc.Loader):
            def __init__(self, loader, after): self.loader, self.after = loader, after
            def create_module(self, spec): return self.loader.create_module(spec)
            def exec_module(self, module): self.loader.exec_module(module); self.after(module)

        def _keras_mnist(module):  # the download step answers with the generated file
            module.get_file = lambda *args, **kwargs: _MNIST

        _MAX_STEPS = int(os.environ.get("HVD_EXAMPLES_MAX_STEPS", "0"))

        def _cap_take(tf):  # tf.data's take(n) gives at most _MAX_STEPS elements
            take = tf.data.Dataset.take
            def capped(self, count, name=None):
                return take(self, min(int(count), _MAX_STEPS) if int(count) >= 0 else _MAX_STEPS, name=name)
            tf.data.Dataset.take = capped

        def _cap_fit(module):  # fit(steps_per_epoch=n) runs at most _MAX_STEPS steps an epoch
            fit = module.Model.fit
            def capped(self, *args, **kwargs):
                if kwargs.get("steps_per_epoch"):
                    kwargs["steps_per_epoch"] = min(kwargs["steps_per_epoch"], _MAX_STEPS)
                return fit(self, *args, **kwargs)
            module.Model.fit = capped

        def _mx_download(url, fname=None, dirname=None, overwrite=False, retries=5):
            import shutil  # MXNet's MNIST zip (idx files), generated beside mnist.npz
            dirname = dirname or "."
            os.makedirs(dirname, exist_ok=True)
            target = os.path.join(dirname, fname or url.split("/")[-1])
            shutil.copyfile(os.path.join(os.path.dirname(_MNIST), "mnist.zip"), target)
            return target

        def _mx_test_utils(module):
            module.download = _mx_download

        class _SummaryWriter:
            def __init__(self, log_dir=None, *args, **kwargs):
                self.path = os.path.join(log_dir or "runs", "scalars.csv")
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
            def add_scalar(self, tag, value, step=None, *args, **kwargs):
                with open(self.path, "a") as f: f.write(f"{tag},{step},{float(value)}\\n")
            def flush(self): pass
            def close(self): pass

        class _Hooks(importlib.abc.MetaPathFinder, importlib.abc.Loader):
            def find_spec(self, name, path=None, target=None):
                if name == "torch.utils.tensorboard" and importlib.util.find_spec("tensorboard") is None:
                    return importlib.util.spec_from_loader(name, self)
                after = {"keras.src.datasets.mnist": _keras_mnist, "tf_keras.src.datasets.mnist": _keras_mnist,
                         "mxnet.test_utils": _mx_test_utils}.get(name)
                if _MAX_STEPS and name in ("tensorflow", "tf_keras.src.engine.training"):
                    after = _cap_take if name == "tensorflow" else _cap_fit
                if after is not None:
                    for finder in sys.meta_path:
                        spec = None if finder is self else finder.find_spec(name, path, target)
                        if spec is not None:
                            spec.loader = _Wrap(spec.loader, after)
                            return spec
                return None
            def create_module(self, spec): return None
            def exec_module(self, module): module.SummaryWriter = _SummaryWriter

        sys.meta_path.insert(0, _Hooks())
        ''',
}


def make_data(root: Path, home: Path, seed: int = 0) -> Path:
    """Generated MNIST (npz, Keras's layout) and ImageNet-shaped PNG folders; the npz path."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)

    def digits(n):
        y = rng.integers(0, 10, n).astype(np.uint8)
        x = rng.integers(0, 60, (n, 28, 28)).astype(np.uint8)
        for i, label in enumerate(y):
            r, c = 3 + 6 * (label // 4), 3 + 6 * (label % 4)
            x[i, r:r + 6, c:c + 6] = 255
        return x, y
    (xtr, ytr), (xte, yte) = digits(MNIST_TRAIN), digits(MNIST_TEST)
    npz = home / ".keras" / "datasets" / "mnist.npz"
    npz.parent.mkdir(parents=True)
    np.savez(npz, x_train=xtr, y_train=ytr, x_test=xte, y_test=yte)
    for part, per_class in (("train", 4), ("val", 2)):
        for k, cls in enumerate(("n01440764", "n01443537")):
            d = root / "imagenet" / part / cls
            d.mkdir(parents=True)
            for i in range(per_class):
                img = rng.integers(0, 256, (64, 64, 3)).astype(np.uint8)
                img[:, :, k] //= 2
                Image.fromarray(img).save(d / f"{i}.png")
    (root / "mnist").mkdir()
    write_mnist_idx_zip(npz)
    return npz


def write_mnist_idx_zip(npz: Path) -> Path:
    """mnist.zip beside ``npz``: the same digits as MNIST's idx files (what MXNet's
    MNISTIter reads): big-endian magic 2051/2049, the dimensions, then the bytes."""
    import struct
    import zipfile

    import numpy as np
    path = npz.with_name("mnist.zip")
    with np.load(npz) as f, zipfile.ZipFile(path, "w") as zf:
        for part, prefix in (("train", "train"), ("test", "t10k")):
            x, y = f[f"x_{part}"], f[f"y_{part}"]
            zf.writestr(f"{prefix}-images-idx3-ubyte", struct.pack(">4I", 2051, *x.shape) + x.tobytes())
            zf.writestr(f"{prefix}-labels-idx1-ubyte", struct.pack(">2I", 2049, len(y)) + y.tobytes())
    return path


def first_error(output: str) -> str:
    """The exception line of the first traceback in the output, else its last line."""
    lines = [x.rstrip() for x in output.splitlines() if x.strip()]
    for i, line in enumerate(lines):
        if line.lstrip().startswith("Traceback"):
            for later in lines[i + 1:]:
                # (TensorFlow's "TypeError: in user code:" is followed by the real one)
                if re.match(r"^\s*(\[\S+\]\s*)?[\w.]*(Error|Exception|Exit|Interrupt)\b", later) \
                        and not later.rstrip().endswith("in user code:"):
                    return later.strip()[:300]
    return lines[-1][:300] if lines else ""


def sweep(workdir: Path) -> None:
    """Kill what a timed-out run left behind: processes whose working directory is its own."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(os.readlink(f"/proc/{pid}/cwd")).is_relative_to(workdir):
                os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def run_example(args, script: str, spec, shim: Path, data: Path, home: Path, tmp: Path) -> dict:
    group, script_args, marker, reason = spec
    path = Path(args.horovod_src) / script.split(" [")[0]
    if reason or not path.is_file():
        return {"script": script, "outcome": "skipped", "seconds": 0.0,
                "line": reason or f"{path} does not exist"}
    stem = re.sub(r"\W+", "_", Path(script).name).strip("_")
    work = tmp / "work" / stem
    work.mkdir(parents=True)
    argv = [a.replace("@DATA@", str(data)).replace("@WORK@", str(work)) for a in script_args]
    python = os.path.abspath(args.python) if args.python else sys.executable
    cmd = ["flock", LOCK, "timeout", "--foreground", "-k", "10", str(args.timeout),
           str(Path(python).with_name("hvdrun")) if args.python else HVDRUN,
           "-np", str(args.np), python, str(path), *argv]
    env = shim_env(shim, [path.parent])
    env["HOME"] = str(home)
    if group in LEGACY_KERAS_GROUPS:
        env["TF_USE_LEGACY_KERAS"] = "1"
    if script in MAX_STEPS:
        env["HVD_EXAMPLES_MAX_STEPS"] = str(MAX_STEPS[script])
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=work, env=env, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output, _ = proc.communicate()
    seconds = round(time.monotonic() - start, 1)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    sweep(work)
    Path(tmp, "logs").mkdir(exist_ok=True)
    Path(tmp, "logs", stem + ".log").write_text(output)
    if proc.returncode in (124, 137):
        outcome, line = "hang", f"no end after {args.timeout} s: {first_error(output)}"
    elif proc.returncode != 0:
        outcome, line = "failed", first_error(output)
    elif marker and not re.search(marker, output, re.M):
        outcome, line = "failed", f"exit 0 but no {marker!r} in the output"
    else:
        outcome, line = "passed", ""
    return {"script": script, "outcome": outcome, "seconds": seconds, "line": line,
            "rc": proc.returncode, "output_tail": output[-4000:] if outcome != "passed" else ""}


def table(results: list[dict]) -> str:
    rows = ["| script | outcome | seconds | first error line (or reason) |", "|---|---|---|---|"]
    rows += [f"| {r['script']} | {r['outcome']} | {r['seconds']} | {r['line'].replace('|', '/')} |"
             for r in results]
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--horovod-src", default=os.environ.get("HOROVOD_SRC"),
                   help="Horovod checkout or export holding examples/ (default $HOROVOD_SRC)")
    p.add_argument("--group", action="append", choices=["pytorch", "tensorflow2", "keras", "mxnet"],
                   help="run only this group (repeat for more; default all)")
    p.add_argument("-k", dest="k", action="append", default=[],
                   help="run only scripts whose path holds this (repeat: any of them)")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--timeout", type=int, default=600, help="seconds per script")
    p.add_argument("--json", help="write every script's outcome here")
    p.add_argument("--md", help="write the table (markdown) here")
    p.add_argument("--keep-logs", help="copy each script's full output into this folder")
    p.add_argument("--python", default=None,
                   help="the ranks' python (its venv's hvdrun launches them): "
                        ".venv-mxnet/bin/python for --group mxnet; default: this one")
    args = p.parse_args(argv)
    if not args.horovod_src or not Path(args.horovod_src, "examples").is_dir():
        p.error("give --horovod-src DIR (or set HOROVOD_SRC): a Horovod export holding examples/")
    chosen = {s: spec for s, spec in EXAMPLES.items()
              if (not args.group or spec[0] in args.group) and (not args.k or any(k in s for k in args.k))}
    results = []
    with tempfile.TemporaryDirectory(prefix="horovod_examples_") as tmp:
        tmp = Path(tmp)
        shim, data, home = tmp / "shim", tmp / "data", tmp / "home"
        write_shim(shim)
        npz = make_data(data, home)
        for rel, text in STANDINS.items():
            target = shim / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(textwrap.dedent(text).lstrip().replace("@MNIST@", repr(str(npz))))
        for i, (script, spec) in enumerate(chosen.items(), 1):
            res = run_example(args, script, spec, shim, data, home, tmp)
            results.append(res)
            print(f"[{i}/{len(chosen)}] {res['outcome']:7} {res['seconds']:6.1f}s {script}"
                  + (f"  -- {res['line']}" if res["line"] else ""), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps({"np": args.np, "scripts": results}, indent=1))
        if args.keep_logs:
            Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
            for log in (tmp / "logs").glob("*.log"):
                Path(args.keep_logs, log.name).write_text(log.read_text())
    text = table(results)
    print("\n" + text)
    if args.md:
        Path(args.md).write_text(text + "\n")
    return 0 if all(r["outcome"] in ("passed", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
