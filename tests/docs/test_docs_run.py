"""The getting-started pages run: every command on them is executed, in order, as a reader would type it,
against a real `corral up`, and the outcome each page states is checked.

The convention. An HTML comment on its own line marks the fenced block that follows it (blank lines may sit
between; MkDocs passes the comment into the HTML, where a browser shows nothing of it):

    <!-- docs-test: run -->                 run the block (bash, or python); it must exit 0
    <!-- docs-test: background -->          start it and leave it running, as in a second terminal (`corral
                                            up`); the page's end stops it with Ctrl-C (SIGINT), and it must
                                            then exit 0
    <!-- docs-test: file cluster.yaml -->   the block is a file the reader saves (a spec): the test writes it
    <!-- docs-test: skip WHY -->            not run, for the reason written after `skip`
    ... needs=gpu                           (after run/background/file) needs an NVIDIA GPU: run only where
                                            `nvidia-smi -L` lists one and CORRAL_DOCS_GPU=1 (it fetches vLLM
                                            and the model's weights), else skipped, saying which
    ... needs=ray / needs=kubernetes        needs several servers / a Kubernetes cluster: never run here
    ... id=NAME                             the block's outcome is checked by OUTCOMES[NAME] on its output
    ... retry=SECONDS                       the outcome is awaited: the block runs again until it holds (usage
                                            is written to the store in batches; a revoked key lives on in a
                                            gateway's key cache for auth.cache_ttl)

Every bash, sh, python and yaml block on the getting-started pages and the tenants page carries a marker: an
unmarked one fails `test_every_command_block_is_marked`, so no instruction goes unexecuted by oversight.
Blocks in other languages (`text`: what a program prints) are not run. Each page must say in words what its
not-run blocks need; the markers are invisible.

How a page runs: in one fresh working directory, like one reader's terminal. Each bash block runs with
`set -a -e -o pipefail` and begins with the environment, shell functions and directory the previous one left
(`set -a` exports what a block sets, so a variable set in one block is seen by the next, as in a shell;
python blocks therefore see them too). python blocks run with the repository's .venv Python. PATH starts with
the repository's .venv/bin (`corral` is .venv/bin/corral, as after `source .venv/bin/activate`).
CORRAL_HOME is a fresh directory whose models/ and engines/ link to corral's own cache, as `make test`
(`corral prepare -f tests/data/cluster.yaml`) and `make up` left it, so keys, usage and logs start empty and
nothing large is fetched or built again.

To refresh the sample output a page shows, set CORRAL_DOCS_OUTPUT=DIR: each block's stdout and stderr are
written there as PAGE-LINE.out.

The port: the pages say 127.0.0.1:8000. Where something else listens there (other clusters on a shared
machine) the test uses a free port instead: every `127.0.0.1:8000` in a block becomes `127.0.0.1:PORT`, and
a background `corral up` gets `--port PORT`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from corral.cluster import free_port
from corral.config import Paths

pytestmark = pytest.mark.slow  # starts real clusters

ROOT = Path(__file__).parents[2]
DOCS = ROOT / "docs"
BIN = ROOT / ".venv" / "bin" if (ROOT / ".venv" / "bin" / "corral").exists() else Path(sys.executable).parent
EXECUTED = ["getting-started/laptop.md", "tenants.md"]  # the embedded default: executed here, every block
ELSEWHERE = ["getting-started/gpu-server.md", "getting-started/ray.md", "getting-started/kubernetes.md"]
COMMAND_LANGUAGES = {"bash", "sh", "shell", "python", "yaml"}
PAGE_PORT = 8000
INSTALL_NOT_RUN = "installing corral: the test runs from this checkout's .venv"
BLOCK_TIMEOUT = 120  # a block's longest run (`corral prepare` with everything cached takes seconds)

_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")


@dataclass(frozen=True)
class Block:
    """One fenced block of a page, with its marker (None: unmarked)."""

    page: str
    line: int
    lang: str
    text: str
    mode: str | None = None  # run | background | file | skip
    name: str | None = None  # file: the file name; skip: the reason
    options: dict[str, str] = field(default_factory=dict)

    def where(self) -> str:
        return f"{self.page}:{self.line}"


def parse_page(page: str) -> list[Block]:
    """Every fenced block of docs/PAGE in order, each with the marker right above it (if any)."""
    lines = (DOCS / page).read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    marker: tuple[str, int] | None = None
    i = 0
    while i < len(lines):
        if (found := _MARKER.match(lines[i])) is not None:
            marker = (found["body"], i + 1)
        elif (fence := _FENCE.match(lines[i])) is not None:
            indent, close = len(fence["indent"]), fence["fence"]
            end = i + 1
            while end < len(lines) and not lines[end].strip().startswith(close):
                end += 1
            text = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
            blocks.append(_block(page, i + 1, fence["lang"].lower(), text, marker))
            marker, i = None, end
        elif lines[i].strip() and marker is not None:
            raise AssertionError(f"{page}:{marker[1]}: a docs-test marker not followed by a fenced block")
        i += 1
    return blocks


def _block(page: str, line: int, lang: str, text: str, marker: tuple[str, int] | None) -> Block:
    if marker is None:
        return Block(page, line, lang, text)
    mode, _, rest = marker[0].partition(" ")
    if mode == "skip":
        return Block(page, line, lang, text, mode, rest.strip())
    words = rest.split()
    options = dict(word.split("=", 1) for word in words if "=" in word)
    names = [word for word in words if "=" not in word]
    assert mode in ("run", "background", "file"), f"{page}:{marker[1]}: unknown docs-test mode {mode!r}"
    assert (mode == "file") == (len(names) == 1), f"{page}:{marker[1]}: `file NAME` names one file"
    assert set(options) <= {"id", "needs", "retry"}, f"{page}:{marker[1]}: unknown option in {options}"
    assert options.get("needs") in (None, "gpu", "ray", "kubernetes"), f"{page}:{marker[1]}: needs what?"
    return Block(page, line, lang, text, mode, names[0] if names else None, options)


@dataclass
class Output:
    """What one block did."""

    returncode: int
    stdout: str
    stderr: str


class Terminal:
    """One reader's terminal: a working directory, an environment carried from block to block, and the
    commands left running in other terminals (`corral up`)."""

    def __init__(self, workdir: Path, env: dict[str, str], port: int) -> None:
        self.cwd = workdir
        self.env = env
        self.port = port
        self._state = workdir / ".docs-test"
        self._state.mkdir()
        self.background: list[tuple[Block, subprocess.Popen[bytes], Path]] = []

    def localise(self, text: str) -> str:
        if self.port == PAGE_PORT:
            return text
        return text.replace(f"127.0.0.1:{PAGE_PORT}", f"127.0.0.1:{self.port}")

    def run(self, block: Block) -> Output:
        text = self.localise(block.text)
        if block.lang == "python":
            done = subprocess.run(
                [str(BIN / "python"), "-"],
                input=text,
                cwd=self.cwd,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=BLOCK_TIMEOUT,
            )
            return Output(done.returncode, done.stdout, done.stderr)
        script = self._state / "block.sh"
        script.write_text(text)
        env_file, cwd_file = self._state / "env", self._state / "cwd"
        done = subprocess.run(
            [
                "bash",
                "-c",
                'set -a -e -o pipefail; source "$1"; env -0 > "$2"; pwd > "$3"',
                "block",
                str(script),
                str(env_file),
                str(cwd_file),
            ],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT,
        )
        if done.returncode == 0:
            pairs = (item.split("=", 1) for item in env_file.read_text().split("\0") if "=" in item)
            self.env = {k: v for k, v in pairs if k not in ("_", "SHLVL", "OLDPWD")}
            self.cwd = Path(cwd_file.read_text().strip())
        return Output(done.returncode, done.stdout, done.stderr)

    def start(self, block: Block) -> None:
        text = self.localise(block.text)
        if self.port != PAGE_PORT:
            text = re.sub(r"\bcorral up\b", f"corral up --port {self.port}", text)
        log = self._state / f"background-{len(self.background)}.log"
        process = subprocess.Popen(
            ["bash", "-c", text],
            cwd=self.cwd,
            env=self.env,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, which Ctrl-C reaches as a terminal's would
        )
        self.background.append((block, process, log))

    def write(self, block: Block) -> None:
        assert block.name is not None
        (self.cwd / block.name).write_text(self.localise(block.text))

    def stop_all(self) -> list[str]:
        """Ctrl-C to what runs in the background; each must stop cleanly. Returns what did not."""
        problems = []
        for block, process, log in reversed(self.background):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGINT)
            try:
                code = process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                code = process.wait()
            if code != 0:
                problems.append(f"{block.where()} exited {code} after Ctrl-C:\n{log.read_text()[-3000:]}")
        self.background.clear()
        return problems

    def background_logs(self) -> str:
        return "\n".join(f"--- {b.where()}:\n{log.read_text()[-3000:]}" for b, _, log in self.background)


# ---- the outcomes the pages state, checked on each named block's output ---------------------------------


def _http(out: Output) -> tuple[int, dict[str, str], str]:
    """The last response `curl -i` printed: status, headers (lower-case names) and body. (The output was
    read as text, so its CRLFs are newlines.)"""
    head, body = re.split(r"\r?\n\r?\n", out.stdout.rpartition("HTTP/1.1 ")[2], maxsplit=1)
    status_line, *header_lines = head.splitlines()
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[0]), headers, body


def _json(out: Output) -> Any:
    return json.loads(out.stdout)


def _chat_answered(out: Output) -> None:
    content = _json(out)["choices"][0]["message"]["content"]
    assert isinstance(content, str) and content.strip(), out.stdout


def _printed_text(out: Output) -> None:
    assert len(out.stdout.strip()) > 5, out.stdout


def _status_lists_replicas(out: Output) -> None:
    states = dict(re.findall(r"^\s*((?:smollm2|minilm)-\d)\s+(\w+)", out.stdout, re.M))
    assert set(states) == {"smollm2-0", "smollm2-1", "minilm-0"}, out.stdout
    assert states["minilm-0"] == "ready" and "ready" in (states["smollm2-0"], states["smollm2-1"]), states


def _embedding_384(out: Output) -> None:
    assert out.stdout.split() == ["2", "384"], out.stdout


def _answers_200(out: Output) -> None:
    assert out.stdout.strip() == "200", out.stdout


def _top_shows_replicas(out: Output) -> None:
    shown = out.stdout + out.stderr  # (a live view: corral top draws on stderr)
    assert re.search(r"smollm2-0\s+ready", shown) and "requests/s" in shown, shown


def _usage_counts_smollm2(out: Output) -> None:
    row = re.search(r"^\s*smollm2\s+(\d+)\s", out.stdout, re.M)
    assert row is not None and int(row[1]) >= 3, out.stdout  # curl's chat, the client's whole and streamed


def _spec_closed(out: Output) -> None:
    assert "valid" in out.stdout and "closed (API keys required)" in out.stdout, out.stdout


def _ready(out: Output) -> None:
    assert _json(out)["ready"] is True, out.stdout


def _no_key_401(out: Output) -> None:
    status, _, body = _http(out)
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key", out.stdout


def _secret_kept(out: Output) -> None:
    assert "sk-corral-" not in out.stdout, out.stdout  # the secret went into the variable, not the screen
    assert re.search(r"created key [0-9a-f]+ for tenant acme", out.stderr), out.stderr


def _admitted_with_limits(out: Output) -> None:
    status, headers, body = _http(out)
    assert status == 200, out.stdout
    assert headers["x-ratelimit-limit-requests"] == "3" and headers["x-ratelimit-remaining-requests"] == "2"
    assert json.loads(body)["choices"][0]["message"]["content"], body


def _third_of_the_minute_refused(out: Output) -> None:
    assert out.stdout.split() == ["200", "200", "429"], out.stdout


def _rate_limited(out: Output) -> None:
    status, headers, body = _http(out)
    error = json.loads(body)["error"]
    assert status == 429 and error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
    assert 0 < int(headers["retry-after"]) <= 60, headers
    assert headers["x-ratelimit-remaining-requests"] == "0", headers


def _budget_refused(out: Output) -> None:
    error = _json(out)["error"]
    assert error["code"] == "insufficient_quota" and "Set max_tokens to at most" in error["message"], error


def _admin_created(out: Output) -> None:
    assert out.stdout.strip().startswith("sk-corral-"), out.stdout


_TENANT_ROW = re.compile(r"^\s*(?P<tenant>\w+)\s+(?P<reqs>\d+)\s+[\d,]+\s+[\d,]+\s+(?P<refused>\d+)\s", re.M)


def _usage_by_tenant(out: Output) -> None:
    rows = {m["tenant"]: (int(m["reqs"]), int(m["refused"])) for m in _TENANT_ROW.finditer(out.stdout)}
    assert rows.get("acme") == (5, 2), out.stdout  # 5 requests, 2 of them refused (429)
    assert rows.get("globex") == (1, 1), out.stdout  # refused by its budget


def _keys_listed(out: Output) -> None:
    assert re.search(r"acme\s+smollm2\s+3\s+20k\s", out.stdout), out.stdout


def _admin_usage(out: Output) -> None:
    rows = {row["tenant"]: row for row in _json(out)["rows"]}
    assert rows["acme"]["requests"] == 5 and rows["acme"]["refused"] == 2, rows


def _revoked_401(out: Output) -> None:
    assert out.stdout.strip() == "401", out.stdout


def _spec_valid(out: Output) -> None:
    assert re.search(r": valid: \d+ model", out.stdout), out.stdout


def _planned(out: Output) -> None:
    assert "l40s" in out.stdout and "$/mo" in out.stdout, out.stdout


def _kuberay_rendered(out: Output) -> None:
    assert "wrote deploy/kuberay/corral.yaml" in out.stdout + out.stderr, out.stdout + out.stderr


OUTCOMES: dict[str, Callable[[Output], None]] = {
    # getting-started/laptop.md
    "laptop-ready": _ready,
    "laptop-chat": _chat_answered,
    "laptop-client": _printed_text,
    "laptop-embeddings": _embedding_384,
    "laptop-status": _status_lists_replicas,
    "laptop-console": _answers_200,
    "laptop-top": _top_shows_replicas,
    "laptop-usage": _usage_counts_smollm2,
    # tenants.md
    "tenants-check": _spec_closed,
    "tenants-ready": _ready,
    "tenants-no-key": _no_key_401,
    "tenants-create": _secret_kept,
    "tenants-admitted": _admitted_with_limits,
    "tenants-burst": _third_of_the_minute_refused,
    "tenants-refused": _rate_limited,
    "tenants-budget": _budget_refused,
    "tenants-admin-create": _admin_created,
    "tenants-usage": _usage_by_tenant,
    "tenants-keys": _keys_listed,
    "tenants-admin-usage": _admin_usage,
    "tenants-console": _answers_200,
    "tenants-revoked": _revoked_401,
    # the pages whose clusters need GPUs, Ray or Kubernetes: the blocks that run anywhere
    "gpu-plan": _planned,
    "gpu-check": _spec_valid,
    "ray-check": _spec_valid,
    "kubernetes-check": _spec_valid,
    "kubernetes-render": _kuberay_rendered,
}


# ---- running a page ------------------------------------------------------------------------------------


def _gpu_here() -> str | None:
    """None where GPU blocks may run, else why not."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        listed = ""
    if "GPU" not in listed:
        return "no NVIDIA GPU on this machine"
    if os.environ.get("CORRAL_DOCS_GPU") != "1":
        return "a GPU is here, but CORRAL_DOCS_GPU=1 is not set (the page fetches vLLM and the weights)"
    return None


def _why_not(block: Block) -> str | None:
    """Why this block is not run here (None: it is)."""
    if block.mode == "skip":
        return block.name or "marked skip"
    needs = block.options.get("needs")
    if needs == "gpu":
        return _gpu_here()
    if needs in ("ray", "kubernetes"):
        return f"needs {'several servers joined by Ray' if needs == 'ray' else 'a Kubernetes cluster'}"
    return None


def run_page(page: str, terminal: Terminal) -> list[tuple[Block, str]]:
    """Run every block of the page that can run here, in order, checking each named outcome. Returns the
    blocks left out, with why."""
    left_out: list[tuple[Block, str]] = []
    try:
        for block in parse_page(page):
            if block.mode is None:
                continue  # output shown to the reader (test_every_command_block_is_marked checks the rest)
            if (why := _why_not(block)) is not None:
                left_out.append((block, why))
            elif block.mode == "file":
                terminal.write(block)
            elif block.mode == "background":
                terminal.start(block)
            else:
                _run_checked(block, terminal)
    finally:
        problems = terminal.stop_all()
    assert not problems, "\n".join(problems)
    return left_out


def _run_checked(block: Block, terminal: Terminal) -> None:
    outcome = OUTCOMES.get(block.options.get("id", ""))
    deadline = time.monotonic() + float(block.options.get("retry", "0"))
    while True:
        out = terminal.run(block)
        if keep := os.environ.get("CORRAL_DOCS_OUTPUT"):
            name = f"{block.page.replace('/', '-')}-{block.line}.out"
            (Path(keep) / name).write_text(
                out.stdout + ("\n--- stderr:\n" + out.stderr if out.stderr else "")
            )
        context = (
            f"{block.where()} ({block.lang}) exited {out.returncode}\n--- block:\n{block.text}--- stdout:\n"
            f"{out.stdout[-4000:]}\n--- stderr:\n{out.stderr[-4000:]}\n{terminal.background_logs()}"
        )
        try:
            assert out.returncode == 0, context
            if outcome is not None:
                outcome(out)
            return
        except AssertionError as failed:
            if time.monotonic() >= deadline:
                raise AssertionError(f"{failed}\n{context}") from None
        time.sleep(0.25)  # the retry's poll interval, while its deadline lasts


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture(scope="module")
def corral_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh corral home that shares the real cache's models and engine builds (nothing rebuilt)."""
    cache = Paths.from_env()
    if not (cache.engines.is_dir() and cache.models.is_dir()):
        pytest.fail(f"corral's cache at {cache.home} is empty: run `make test` (or `corral prepare`) first")
    home = tmp_path_factory.mktemp("corral-home")
    (home / "models").symlink_to(cache.models)
    (home / "engines").symlink_to(cache.engines)
    return home


@pytest.fixture
def terminal(tmp_path: Path, corral_home: Path) -> Iterator[Terminal]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CORRAL_", "OPENAI_", "PYTEST_")) and k != "VIRTUAL_ENV"
    }
    env.update(
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        CORRAL_HOME=str(corral_home),
        COLUMNS="120",  # corral's tables as a terminal this wide prints them (the outcomes read them)
        VIRTUAL_ENV=str(BIN.parent),
    )
    workdir = tmp_path / "reader"
    workdir.mkdir()
    port = PAGE_PORT if _port_free(PAGE_PORT) else free_port()
    yield Terminal(workdir, env, port)


# ---- the tests -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", EXECUTED + ELSEWHERE)
def test_every_command_block_is_marked(page: str) -> None:
    blocks = parse_page(page)
    unmarked = [b.where() for b in blocks if b.lang in COMMAND_LANGUAGES and b.mode is None]
    assert not unmarked, f"command blocks without a docs-test marker: {unmarked}"
    stray = [b.where() for b in blocks if b.mode is not None and b.lang not in COMMAND_LANGUAGES]
    assert not stray, f"markers on blocks that are neither commands nor files: {stray}"
    if page in EXECUTED:
        needy = [b.where() for b in blocks if "needs" in b.options]
        assert not needy, f"the embedded default's pages must run everywhere: {needy}"


def test_every_outcome_check_has_its_block() -> None:
    ids = [b.options["id"] for page in EXECUTED + ELSEWHERE for b in parse_page(page) if "id" in b.options]
    assert len(ids) == len(set(ids)), f"an id used twice: {ids}"
    assert set(ids) == set(OUTCOMES), (
        f"no block: {set(OUTCOMES) - set(ids)}; no check: {set(ids) - set(OUTCOMES)}"
    )


def test_pages_for_the_embedded_default_run_every_block(terminal: Terminal) -> None:
    """laptop.md then tenants.md, in one terminal, as one reader would follow them: from nothing to a served
    answer, a tenant key whose limit refuses, usage, and the console. Only installing corral is not run (the
    test runs from the installed checkout)."""
    left_out = [(b.where(), why) for page in EXECUTED for b, why in run_page(page, terminal)]
    assert [why for _, why in left_out] == [INSTALL_NOT_RUN], f"blocks not run: {left_out}"


@pytest.mark.parametrize("page", ELSEWHERE)
def test_blocks_that_need_no_gpu_ray_or_kubernetes_run(page: str, terminal: Terminal) -> None:
    """The GPU, Ray and Kubernetes pages: what runs anywhere (sizing, checking a spec, rendering manifests)
    runs here; test_blocks_that_need_hardware says what does not."""
    run_page(page, terminal)


@pytest.mark.parametrize("page", ELSEWHERE)
def test_blocks_that_need_hardware(page: str) -> None:
    """Skipped, listing each block and what it needs, where that is not here."""
    left_out = [f"{b.where()}: {why}" for b in parse_page(page) if (why := _why_not(b)) is not None]
    if left_out:
        pytest.skip(f"{len(left_out)} block(s) not run here: " + "; ".join(left_out))
