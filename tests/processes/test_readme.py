"""The commands README.md and docs/*.md show: run as they are written, or checked as far as is cheap."""
from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess

from tests.conftest import PY, ROOT, clean_env
from tests.quick.test_readme import README, shell_lines


def test_config_error_example_is_what_the_program_prints():
    block = README.split("anything is written:", 1)[1].split("```", 2)[1]
    command, expected = [line for line in block.splitlines() if line.strip()][:2]
    args = command.removeprefix("$ python -m train ").split()
    proc = subprocess.run([PY, "-m", "train", *args], cwd=ROOT, env=clean_env(), capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip() == expected


def test_check_prints_the_resolved_config():
    proc = subprocess.run([PY, "-m", "train", "--config", "configs/default.yaml", "--check", "train.steps=7"],
                          cwd=ROOT, env=clean_env(), capture_output=True, text=True)
    assert proc.returncode == 0 and "steps: 7" in proc.stdout


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


# Words a doc writes for the reader to fill in (tasks/my*: the reader's own task, docs/containers.md); a command is
# checked up to them.
PLACEHOLDERS = {"...", "key.sub=value", "configs/other.yaml", "my.yaml", "tasks/my.yaml", "tasks/my_task.py",
                "RUN_DIR", "FILE", "NAMESPACE", "IMAGE"}


REPO_PATH = re.compile(r"^(?:train|tests|bench|configs|examples|tasks|k8s|slurm|docs|\.ci)/[\w./-]*$|"
                       r"^(?:Dockerfile|Makefile|docker-compose\.yml|BENCHMARKS\.(?:md|png)|requirements(?:-dev)?\.txt|"
                       r"pyproject\.toml|\.dockerignore)$")


LAUNCHERS = ("python -m ", "make ", "sudo make ", "sbatch ", "kubectl apply ", "kubectl delete ", "torchrun ",
             ".venv/bin/python ", "python tests/")


def doc_commands(text: str) -> list[str]:
    """The commands a page shows: each line of its bash blocks (continuations joined, comments cut) and each
    inline code span that starts like a command."""
    commands = shell_lines(text)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())
        if any(re.sub(r"^(?:[A-Z_]+=\S+\s+)+", "", span).startswith(p) for p in LAUNCHERS):
            commands.append(span)
    return commands


def all_commands() -> list[tuple[str, str]]:
    """(page, command) for every command of every page; `a && b` is two."""
    return [(doc.relative_to(ROOT).as_posix(), part.strip()) for doc in DOCS for c in doc_commands(doc.read_text())
            for part in re.split(r"\s(?:&&|\|\||;|\|)\s", c)]


def make_targets() -> set[str]:
    rules = re.findall(r"^([\w.-]+(?: [\w.-]+)*)\s*:(?!=)", (ROOT / "Makefile").read_text(), re.M)
    return {target for rule in rules for target in rule.split()}  # `venv-torch test-torch:` names two


def split_command(command: str) -> tuple[dict, list[str], list[str]]:
    """The leading VAR=value assignments, the words up to the first placeholder, and all the words."""
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    env = {}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        k, _, v = words.pop(0).partition("=")
        env[k] = v
    if words[:1] == ["sudo"]:
        words.pop(0)
    if words[:1] in ([".venv/bin/python"], ["python3"]):
        words[0] = "python"
    if words[:1] == ["torchrun"] and "-m" in words:  # torchrun [its options] -m MODULE args
        words = ["python", *words[words.index("-m"):]]
    if words[:2] == ["docker", "run"]:  # the image's entrypoint is the launcher: what follows it is its args
        image = next((i for i, w in enumerate(words) if w.startswith("ddp-template:")), len(words))
        words = ["python", "-m", "train.launch", *words[image + 1:]]
    cut = next((i for i, w in enumerate(words) if w in PLACEHOLDERS or "..." in w), len(words))
    return env, words[:cut], words


def check_config(where: str, config: str | None, overrides: list[str]) -> str | None:
    """The config a command would train with loads and validates (train.config.load: typed keys, ranges),
    as `python -m train --check` does before anything is written. None when it does; else the error."""
    from train import config as train_config
    if config in PLACEHOLDERS:
        return None
    config = config or "configs/default.yaml"
    if not (ROOT / config).is_file():
        return f"{where}: config {config} does not exist"
    try:
        train_config.load(str(ROOT / config), overrides)
    except train_config.ConfigError as e:
        return f"{where}: {config} {overrides}: {e}"
    return None


def train_args(args: list[str]) -> tuple[str | None, list[str]]:
    """--config and the key=value overrides of `python -m train`'s arguments (a --config cut off at a
    placeholder is one)."""
    config = "..." if args[-1:] == ["--config"] else None
    for i, w in enumerate(args[:-1]):
        if w == "--config":
            config = args[i + 1]
    return config, [w for w in args if "=" in w and not w.startswith("-")]


def command_problems(where: str, command: str, options: dict[str, set[str]]) -> list[str]:
    """What is wrong with one command; options collects each `python -m train.X` module's options shown."""
    env, words, every = split_command(command)
    problems = [f"{where}: `{command}` names {w}, which is not in the repository"
                for w in [*words, *env.values()]
                if w not in PLACEHOLDERS and REPO_PATH.match(w) and not (ROOT / w).exists()]
    if words[:2] == ["python", "-m"] and len(words) > 2:
        module, args = words[2], words[3:]
        if module == "train":
            problems.append(check_config(where, *train_args(args)))
        elif module.startswith("train."):
            # Its own options, then the training arguments: after `--`, or (the launcher) from --config on.
            every = every[every.index(module) + 1:]
            mark = "--" if "--" in every else "--config" if module == "train.launch" and "--config" in every else None
            ours = every[:every.index(mark)] if mark else every
            options.setdefault(module, set()).update(
                w.strip("[]").split("=")[0] for w in ours if w.strip("[]").startswith("--"))
            if mark in args:
                problems.append(check_config(where, *train_args(args[args.index(mark) + (mark == "--"):])))
            elif "--config" in args:  # train.doctor's own --config
                problems.append(check_config(where, *train_args(args)))
        elif importlib.util.find_spec(module.rsplit(".", 1)[0]) is None:
            problems.append(f"{where}: `{command}`: no module {module}")
    elif words[:1] == ["make"]:
        targets = [w for w in words[1:] if "=" not in w]
        variables = dict(w.split("=", 1) for w in words[1:] if "=" in w)
        problems += [f"{where}: `{command}`: the Makefile has no target {t}" for t in targets
                     if t not in make_targets()]
        if targets in ([], ["train-local"]) and ("CONFIG" in variables or "ARGS" in variables):
            problems.append(check_config(where, variables.get("CONFIG"), shlex.split(variables.get("ARGS", ""))))
    elif words[:1] == ["sbatch"]:
        script = next((i for i, w in enumerate(words) if w.endswith(".sbatch")), None)
        if script is not None:
            problems.append(check_config(where, env.get("CONFIG"), words[script + 1:]))
    for i, script in enumerate(every):  # the options a command gives a script of ours are ones it defines
        if script.endswith(".py") and (ROOT / script).is_file():
            source = (ROOT / script).read_text()
            problems += [f"{where}: `{command}`: {script} has no option {w}" for w in every[i + 1:]
                         if w.startswith("--") and f'"{w.split("=")[0]}"' not in source]
    return [p for p in problems if p]


# `python -m MODULE --help` for each module in one process (runpy): torch is imported once, not per module.
HELP = """
import contextlib, io, json, runpy, sys
out = {}
for module in sys.argv[1:]:
    sys.argv, text = [module, "--help"], io.StringIO()
    try:
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out[module] = [code, text.getvalue()]
print(json.dumps(out))
"""


def module_help(modules: list[str]) -> dict[str, tuple[int, str]]:
    proc = subprocess.run([PY, "-c", HELP, *modules], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {m: tuple(v) for m, v in json.loads(proc.stdout.splitlines()[-1]).items()}


def link_problems() -> list[str]:
    """Links between the pages point at files that exist and at headings that are there."""
    def anchors(path):
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                for h in re.findall(r"^#+ (.*)$", path.read_text(), re.M)}
    problems = []
    for doc in DOCS:
        prose = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"^[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                problems.append(f"{doc.name}: link to {target}: no such file")
            elif anchor and anchor not in anchors(path):
                problems.append(f"{doc.name}: link to {target}: no such heading")
        for span in re.findall(r"`([^`\s]+)`", prose):
            if REPO_PATH.match(span) and span not in PLACEHOLDERS and not (ROOT / span).exists():
                problems.append(f"{doc.name}: `{span}` is not in the repository")
    return problems


def layout_problems() -> list[str]:
    """The README's tree names files and folders that exist (a moved module moves in the tree too)."""
    block = README.split("## Layout", 1)[1].split("```", 2)[1]
    problems, stack = [], []  # (indent, folder)
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        names = re.split(r"\s{2,}", line.strip())[0]
        stack = [(i, f) for i, f in stack if i < indent]
        parent = stack[-1][1] if stack else ""
        for name in names.split(", "):
            path = f"{parent}{name}"
            if not (ROOT / path).exists():
                problems.append(f"README Layout: {path} does not exist")
            if name.endswith("/"):
                stack.append((indent, path))
    return problems


def test_every_command_the_docs_show_is_real():
    """Each command in README.md and docs/*.md: the config it trains with validates, the module it runs
    exists and takes the options shown, the make target exists, the files it names are in the repository;
    the pages' links and the README's tree point at what exists."""
    commands = all_commands()
    assert len(commands) > 50, commands  # the extraction found the docs' commands
    options: dict[str, set[str]] = {}
    # The launcher's table of options (docs/launcher.md): each is one `python -m train.launch --help` lists.
    table = [line for line in (ROOT / "docs" / "launcher.md").read_text().splitlines() if line.startswith("| `--")]
    options["train.launch"] = {re.match(r"\| `(--[\w-]+)", line).group(1) for line in table}
    problems = [p for where, c in commands for p in command_problems(where, c, options)]
    for module, (code, text) in module_help(sorted(options)).items():
        if code != 0:
            problems.append(f"`python -m {module} --help` exits {code}: {text[-300:]}")
        if module == "train.launch.torchrun":  # torchrun's own process: torchrun's help
            continue
        if not text.startswith(f"usage: python -m {module} "):
            problems.append(f"`python -m {module} --help` prints another's usage: {text[:80]!r}")
        about = re.split(r"\n\n(?:positional arguments|options):", text)[0].split("\n\n")[-1].strip()
        if not about.endswith((".", ")")) or about.startswith("usage:"):
            problems.append(f"`python -m {module} --help`: its description is not whole: {about[-80:]!r}")
        problems += [f"`python -m {module}` has no option {o} (docs show it)" for o in sorted(options[module])
                     if not re.search(rf"(?<![\w-]){o}(?![\w-])", text)]
    problems += link_problems() + layout_problems()
    assert not problems, "\n".join(problems)


def test_the_configuration_reference_is_the_code_s_every_key():
    """docs/reference.md is what `python -m train.reference` writes from the dataclasses and the built-in tasks'
    Configs: every key there (none missing, none left over), each with a meaning; `--check` says when it drifts."""
    from train import config, reference

    text = (ROOT / "docs" / "reference.md").read_text()
    assert text == reference.page(), "docs/reference.md is out of date: python -m train.reference > docs/reference.md"
    rows = re.findall(r"^\| `([\w.]+)` \| `[^`]*` \| ([^|]*) \|", text, re.M)
    listed = {k for k, _ in rows}
    assert {k for k, _, _ in reference.keys(config.Config)} <= listed and "checkpoint.async" in listed
    assert not [k for k, meaning in rows if not meaning.strip()], "keys without a meaning (a comment on their line)"
    proc = subprocess.run([PY, "-m", "train.reference", "--check"], cwd=ROOT, env=clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
