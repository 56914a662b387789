"""fastpin among the tools around it: type stubs and py.typed, the version,
logging, DataLoader subclasses, torchdata's StatefulDataLoader, PyTorch
Lightning and HuggingFace Accelerate training loops (on the CPU)."""
from __future__ import annotations

import ast
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import fastpin
from fastpin._walk import map_leaves
from fastpin import _C
from conftest import assert_same, in_arena, patterned

PACKAGE = Path(fastpin.__file__).parent
REPO = Path(__file__).resolve().parent.parent
N, BATCH = 24, 4


class Samples(Dataset):
    """Item i: a patterned image and tokens, and i."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"image": patterned((3, 8, 8), torch.float32, i),
                "tokens": patterned((5,), torch.int64, 500 + i), "index": i}


def check_batch(batch, first):
    """The batch holds samples first.. first+BATCH-1, bit for bit."""
    idx = list(range(first, first + BATCH))
    assert batch["index"].tolist() == idx
    assert_same(batch["image"], torch.stack([patterned((3, 8, 8), torch.float32, i) for i in idx]))
    assert_same(batch["tokens"], torch.stack([patterned((5,), torch.int64, 500 + i) for i in idx]))


def tensors(batch):
    return [v for v in batch.values() if isinstance(v, torch.Tensor)]


# ---- type stubs ---------------------------------------------------------------------

def stub_names() -> dict:
    """{'': module-level names, 'Arena': its members, ...} declared in _C.pyi."""
    tree = ast.parse((PACKAGE / "_C.pyi").read_text())
    names: dict = {"": set()}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names[""].add(node.name)
            members = names.setdefault(node.name, set())
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[""].add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[""].add(node.target.id)
    return names


def public(names) -> set:
    return {n for n in names if not n.startswith("_")}


def test_stubs_declare_exactly_the_extension():
    stubs = stub_names()
    assert public(dir(_C)) == public(stubs[""]), "fastpin/_C.pyi is out of step with _C"
    for cls in ("Arena", "Block"):
        runtime = public(set(dir(getattr(_C, cls))) - set(dir(object)))
        assert runtime == public(stubs[cls]), f"_C.{cls} and its stub differ"
    for cls in ("Arena", "Block"):
        for dunder in ("__dlpack__", "__dlpack_device__"):
            assert (dunder in dir(getattr(_C, cls))) == (dunder in stubs[cls])


def test_stubs_and_marker_ship_with_the_package():
    # make test runs against fastpin installed with pip: these are the wheel's files.
    assert (PACKAGE / "py.typed").is_file()
    assert (PACKAGE / "_C.pyi").is_file()
    pyproject = REPO / "pyproject.toml"
    if pyproject.is_file():
        import tomllib

        data = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]
        assert {"py.typed", "*.pyi"} <= set(data["fastpin"])


GOOD = """
import numpy as np
import fastpin
from fastpin import _C

arena = _C.Arena(1 << 20, cuda=False)
block, offsets = arena.pin([(0, 64)], 1)
n: int = block.nbytes + offsets[0] + arena.capacity + block.ptr
high_water: int = arena.stats()["high_water"]
registered: bool = arena.stats()["registered"]
view = block.numpy(0, (8,), (8,), np.float64)
state: str = _C.cuda_status()["state"]
reason: str = fastpin.cuda_status().reason
ok: bool = fastpin.cuda_available()
version: str = fastpin.__version__
fastpin.configure(capacity=1 << 20, threads=2)
try:
    arena.alloc(1 << 30)
except fastpin.ArenaFullError as e:
    err: MemoryError = e
shared = _C.Arena(1 << 20, shared=True, cuda=False)
peer: _C.Arena = _C.Arena.attach(shared.fd)
adopted: _C.Block = shared.adopt(block.index, block.nbytes)
gone: int = shared.reclaim() + shared.stats()["fallbacks"] + shared.token
"""

BAD = """
from fastpin import _C
_C.Arena("big")
_C.Arena(1, shared="yes")
threads: str = _C.get_threads()
_C.Arena(1).pin(5)
_C.Arena(1).alloc(8).ptr = 3
_C.Arena(1).stats()["nope"]
_C.Arena(1).collect(2)
"""


def test_mypy_checks_usage_against_the_stubs(tmp_path):
    pytest.importorskip("mypy", reason="mypy is in requirements-dev.txt")
    (tmp_path / "good.py").write_text(GOOD)
    (tmp_path / "bad.py").write_text(BAD)
    (tmp_path / "mypy.ini").write_text(textwrap.dedent("""
        [mypy]
        follow_imports = silent
        [mypy-torch.*]
        follow_imports = skip
        ignore_missing_imports = True
    """))
    # fastpin as this test imported it (installed, or the source tree), found
    # through its py.typed marker like any installed package.
    env = dict(os.environ, PYTHONPATH=str(PACKAGE.parent))
    env.pop("MYPYPATH", None)
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir",
         str(tmp_path / "cache"), "--no-error-summary", "good.py", "bad.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    assert not [e for e in errors if not e.startswith("bad.py")], proc.stdout + proc.stderr
    lines = {int(m.group(1)) for e in errors if (m := re.match(r"bad\.py:(\d+):", e))}
    assert lines == set(range(3, 10)), proc.stdout   # every wrong line, and only those


# ---- version and logging ------------------------------------------------------------

def test_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?\w+)?", fastpin.__version__)
    pyproject = REPO / "pyproject.toml"
    if pyproject.is_file():
        import tomllib

        assert tomllib.loads(pyproject.read_text())["project"]["version"] == fastpin.__version__
    from importlib import metadata

    try:
        installed = metadata.version("fastpin")
    except metadata.PackageNotFoundError:
        return  # an in-place build, not installed
    if PACKAGE.parent != REPO:
        assert installed == fastpin.__version__


def library_sources():
    return sorted(PACKAGE.rglob("*.py"))


def enclosing_functions(tree):
    """{id(node): names of the functions around it}."""
    out = {}

    def walk(node, stack):
        for child in ast.iter_child_nodes(node):
            inner = stack + [child.name] if isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef)) else stack
            out[id(child)] = inner
            walk(child, inner)

    walk(tree, [])
    return out


def test_no_print_in_the_library_but_the_bench_command_line():
    offenders = []
    for path in library_sources():
        tree = ast.parse(path.read_text())
        where = enclosing_functions(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "print"):
                if not (path.parent.name == "bench" and path.name == "__main__.py"
                        and "main" in where[id(node)]):
                    offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not offenders, f"print() in the library: {offenders}"


def test_logging_goes_through_the_fastpin_logger():
    offenders = []
    for path in library_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "logging"):
                continue
            if node.func.attr == "getLogger":
                arg = node.args[0] if node.args else None
                name = arg.value if isinstance(arg, ast.Constant) else None
                if not (isinstance(name, str) and re.fullmatch(r"fastpin(\.\w+)*", name)):
                    offenders.append(f"{path.name}:{node.lineno} getLogger({ast.unparse(arg) if arg else ''})")
            elif node.func.attr in ("debug", "info", "warning", "error", "exception",
                                    "critical", "log", "basicConfig"):
                offenders.append(f"{path.name}:{node.lineno} logging.{node.func.attr}")
    assert not offenders, offenders
    handlers = logging.getLogger("fastpin").handlers
    assert all(isinstance(h, logging.NullHandler) for h in handlers), handlers


def test_a_fallback_is_logged_on_the_fastpin_logger(caplog):
    arena = _C.Arena(64 << 10, cuda=False)
    caplog.set_level(logging.DEBUG, logger="fastpin")
    first = fastpin.pin_memory(patterned((40 << 10,), torch.uint8, 1), arena=arena)
    src = patterned((40 << 10,), torch.uint8, 2)
    second = fastpin.pin_memory(src, arena=arena)   # no room left: the ordinary way
    assert_same(second, src)
    assert not in_arena(second, arena) and in_arena(first, arena)
    records = [r for r in caplog.records if r.name == "fastpin"]
    assert records and "ordinary way" in records[-1].getMessage()
    del first, second


# ---- DataLoader subclasses ----------------------------------------------------------

class TaggedLoader(DataLoader):
    """A DataLoader subclass with state and a method of its own, as projects write."""

    def __init__(self, *args, tag: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.tag = tag

    def describe(self) -> str:
        return f"{self.tag}: {len(self)} batches of {self.batch_size}"


@pytest.mark.parametrize("workers", [0, 2])
def test_subclass_with_install(accelerator, workers):
    loader = TaggedLoader(Samples(), batch_size=BATCH, num_workers=workers, pin_memory=True,
                          tag="train")
    fastpin.install(zero_copy=False)  # pinned by copy, in the default arena
    try:
        batches = list(loader)
    finally:
        fastpin.uninstall()
    assert len(batches) == N // BATCH
    for k, batch in enumerate(batches):
        check_batch(batch, k * BATCH)
        assert all(in_arena(t, fastpin.default_arena()) for t in tensors(batch))


@pytest.mark.parametrize("zero_copy", [False, True])
def test_subclass_with_loader(zero_copy):
    inner = TaggedLoader(Samples(), batch_size=BATCH, num_workers=2, tag="train")
    sized = {"capacity": 8 << 20} if zero_copy else {}  # capacity is zero-copy's alone
    loader = fastpin.Loader(inner, device=None, zero_copy=zero_copy, **sized)
    assert loader.zero_copy == zero_copy
    # The wrapped loader's attributes and methods, as training frameworks expect.
    assert loader.tag == "train" and loader.batch_size == BATCH
    assert loader.describe() == f"train: {N // BATCH} batches of {BATCH}"
    assert isinstance(loader.dataset, Samples) and len(loader) == N // BATCH
    for epoch in range(2):
        n = 0
        for k, batch in enumerate(loader):
            check_batch(batch, k * BATCH)
            assert all(in_arena(t, loader.arena) for t in tensors(batch))
            n += 1
        assert n == N // BATCH


# ---- torchdata's StatefulDataLoader --------------------------------------------------

def stateful():
    return pytest.importorskip(
        "torchdata.stateful_dataloader",
        reason="torchdata does not install here against torch 2.13.0 (requirements-dev.txt)")


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_state_passes_through(workers):
    StatefulDataLoader = stateful().StatefulDataLoader

    def make():
        return StatefulDataLoader(Samples(), batch_size=BATCH, num_workers=workers)

    inner = make()
    # Copying: the Loader iterates `inner` itself (zero-copy iterates a view of
    # it, whose state the Loader's state_dict() gives).
    loader = fastpin.Loader(inner, device=None, depth=1, zero_copy=False)
    it = iter(loader)
    for k in range(2):
        check_batch(next(it), k * BATCH)
    it.close()   # the producer stops: the wrapped loader's state holds still
    state = loader.state_dict()
    assert state == inner.state_dict()

    resumed_inner = make()
    resumed = fastpin.Loader(resumed_inner, device=None)
    resumed.load_state_dict(state)
    rest = list(resumed)
    # It resumes where the wrapped loader stood: past what was consumed, and at
    # most depth + 1 batches that the Loader had prepared ahead.
    done = N // BATCH - len(rest)
    assert 2 <= done <= 4
    for k, batch in enumerate(rest):
        check_batch(batch, (done + k) * BATCH)
        assert all(in_arena(t, resumed.arena) for t in tensors(batch))


def test_state_dict_of_a_loader_without_one_is_a_clear_error():
    loader = fastpin.Loader([1, 2, 3], device=None)
    with pytest.raises(AttributeError, match="no state_dict"):
        loader.state_dict()


# ---- PyTorch Lightning -----------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning")
@pytest.mark.filterwarnings("ignore:GPU available but not used")
def test_lightning_trains_on_fastpin_batches():
    L = pytest.importorskip("lightning", reason="lightning is in requirements-dev.txt")

    class Model(L.LightningModule):
        """The README's recipe: train_dataloader returns a fastpin.Loader."""

        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(3 * 8 * 8, 1)
            self.seen: list = []
            self.loader = None

        def train_dataloader(self):
            inner = DataLoader(Samples(), batch_size=BATCH, num_workers=2)
            device = None if self.trainer.strategy.root_device.type == "cpu" \
                else self.trainer.strategy.root_device
            self.loader = fastpin.Loader(inner, device=device)
            return self.loader

        def training_step(self, batch, i):
            check_batch(batch, i * BATCH)
            if self.device.type == "cpu":
                assert all(in_arena(t, self.loader.arena) for t in tensors(batch))
            self.seen.append(i)
            return self.net(batch["image"].flatten(1)).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    model = Model()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model)
    assert model.seen == list(range(N // BATCH)) * 2
    assert trainer.global_step == 2 * (N // BATCH)


# ---- HuggingFace Accelerate -------------------------------------------------------------

def test_accelerate_loop_on_fastpin_batches():
    accelerate = pytest.importorskip("accelerate", reason="accelerate is in requirements-dev.txt")
    accelerator = accelerate.Accelerator(cpu=not fastpin.cuda_available())
    model = torch.nn.Linear(3 * 8 * 8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    # The README's recipe: Accelerate shards, fastpin moves.
    prepared = accelerator.prepare_data_loader(
        DataLoader(Samples(), batch_size=BATCH, num_workers=2), device_placement=False)
    device = None if accelerator.device.type == "cpu" else accelerator.device
    loader = fastpin.Loader(prepared, device=device)
    before = [p.detach().clone() for p in model.parameters()]
    for epoch in range(2):
        n = 0
        for k, batch in enumerate(loader):
            # On a GPU the batch arrives there; the reference data lives on the host.
            check_batch(batch if device is None else map_leaves(
                batch, lambda x: isinstance(x, torch.Tensor), lambda t: t.cpu()), k * BATCH)
            if device is None:
                assert all(in_arena(t, loader.arena) for t in tensors(batch))
            optimizer.zero_grad()
            loss = model(batch["image"].flatten(1)).square().mean()
            accelerator.backward(loss)
            optimizer.step()
            n += 1
        assert n == N // BATCH
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_modules_and_functions_stay_readable():
    """A new maintainer's limits (issue 17): no module of the package over 600
    lines, no function over 80."""
    too_long = []
    for path in library_sources():
        source = path.read_text()
        name = path.relative_to(PACKAGE)
        if source.count("\n") > 600:
            too_long.append(f"{name}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80:
                    too_long.append(f"{name}:{node.lineno} {node.name}(): {lines} lines")
    assert not too_long, too_long
