"""deploy/: systemd unit, Dockerfile, compose, Kubernetes manifests and the Helm chart.

No container runtime, cluster or helm binary is needed; what those would reject is checked here:
- every YAML/JSON file under deploy/ parses; Helm templates parse as YAML once their template
  actions are removed, open and close their blocks, and use only values that values.yaml has,
  which in turn has no value that no template uses;
- every flag given to kvmemd, kvmem_worker or kvmemctl anywhere in deploy/ (unit, env file,
  Dockerfile, compose, manifests, flag files, chart) is one the built program lists
  ($KVMEM_BIN/kvmemd --helpfull, KVMEM_BIN defaulting to build/; skipped when not built);
- the Dockerfile copies only paths that exist and the .dockerignore keeps, builds CMake targets
  that exist; compose mounts and builds from paths that exist;
- the manifests wire up: volumes, socket paths, flag files, no /dev/shm volume,
  hardened containers, Service -> pods and ServiceMonitor -> Service selectors;
- the PrometheusRule carries the rules of deploy/prometheus/rules/kvmem.rules.yml, passes
  `promtool check rules` and that file's `promtool test rules` cases (when promtool exists);
- `systemd-analyze verify` accepts the unit and its CUDA drop-in (when systemd-analyze exists);
- deploy/README.md names every file it documents.
"""
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BIN = Path(os.environ.get("KVMEM_BIN", ROOT / "build"))
CHART = DEPLOY / "helm" / "kvmem"
K8S = DEPLOY / "k8s"
SYSTEMD = DEPLOY / "systemd"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"
RULES = DEPLOY / "prometheus" / "rules" / "kvmem.rules.yml"
RULES_TEST = DEPLOY / "prometheus" / "rules" / "kvmem.rules.test.yml"
# Written by others; this test parses them and compares rules with them, nothing more.
FOREIGN = {"grafana", "prometheus"}
PROGRAMS = {"kvmemd", "kvmem_worker", "kvmemctl"}
ALERTS = {"KvmemPoolNearlyFull", "KvmemReclaimFailing", "KvmemStepLatencyHigh",
          "KvmemEvictedAttentionMassSpike", "KvmemRpcErrorRate", "KvmemBlocksForsaken"}


def rel(path):
    return str(Path(path).relative_to(ROOT))


def load_all(path):
    return [d for d in yaml.safe_load_all(Path(path).read_text()) if d is not None]


# ------------------------------------------------------------------------- YAML and JSON


def data_files():
    for path in sorted(DEPLOY.rglob("*")):
        if path.suffix in (".yml", ".yaml", ".json") and CHART / "templates" not in path.parents:
            yield path


@pytest.mark.parametrize("path", list(data_files()), ids=rel)
def test_data_file_parses(path):
    if path.suffix == ".json":
        json.loads(path.read_text())
    else:
        assert load_all(path), f"{rel(path)} holds no document"


# ------------------------------------------------------------------------- Helm templates

ACTION = re.compile(r"{{-?(.*?)-?}}", re.S)
COMMENT = re.compile(r"{{-?\s*/\*.*?\*/\s*-?}}", re.S)
WHOLE_LINE_ACTIONS = re.compile(r"\s*({{.*?}}\s*)+")


def strip_template(text):
    """Template text as YAML: comments and lines made only of actions go, inline actions become X."""
    text = COMMENT.sub("", text)
    lines = [l for l in text.splitlines() if not WHOLE_LINE_ACTIONS.fullmatch(l)]
    return "\n".join(ACTION.sub("X", l) for l in lines) + "\n"


def blocks(text):
    """Checks block nesting and returns {define name: body}."""
    stack, defines = [], {}
    text = COMMENT.sub("", text)
    for m in ACTION.finditer(text):
        words = m.group(1).split()
        word = words[0] if words else ""
        if word in ("if", "with", "range", "define", "block"):
            stack.append((word, m.end(), words[1].strip('"') if len(words) > 1 else ""))
        elif word == "else":
            assert stack and stack[-1][0] in ("if", "with", "range"), f"stray else at {m.start()}"
        elif word == "end":
            assert stack, f"end without a block at offset {m.start()}"
            kind, start, name = stack.pop()
            if kind == "define":
                defines[name] = text[start:m.start()]
    assert not stack, f"unclosed {[s[0] for s in stack]}"
    return defines


def templates():
    return sorted((CHART / "templates").glob("*"))


@pytest.mark.parametrize("path", templates(), ids=rel)
def test_helm_template_blocks_and_yaml(path):
    text = path.read_text()
    defines = blocks(text)
    if path.suffix == ".tpl":
        for name, body in defines.items():
            try:
                yaml.safe_load(strip_template(body))
            except yaml.YAMLError as e:
                pytest.fail(f"define {name} is not YAML without its actions: {e}")
    else:
        try:
            list(yaml.safe_load_all(strip_template(text)))
        except yaml.YAMLError as e:
            pytest.fail(f"{rel(path)} is not YAML without its actions: {e}")


def values_leaves(node, prefix=()):
    if isinstance(node, dict) and node:
        for k, v in node.items():
            yield from values_leaves(v, prefix + (k,))
    else:
        yield prefix


def test_helm_values_all_defined_and_used():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    refs = set()
    for path in templates():
        refs |= {tuple(m.split(".")[1:]) for m in re.findall(r"\.Values((?:\.\w+)+)", path.read_text())}
    missing = []
    for ref in refs:
        node = values
        for key in ref:
            if not isinstance(node, dict) or key not in node:
                missing.append(".".join(ref))
                break
            node = node[key]
    assert not missing, f"templates use values that values.yaml lacks: {sorted(missing)}"
    unused = [".".join(leaf) for leaf in values_leaves(values)
              if not any(leaf[:i] in refs for i in range(1, len(leaf) + 1))]
    assert not unused, f"values.yaml has values no template uses: {unused}"


def test_helm_chart_metadata_and_rules_link():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == CHART.name
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])
    if not RULES.exists():
        pytest.skip(f"{rel(RULES)} not written yet")
    # A link to the rules file, or a copy of it: the same rules either way.
    assert yaml.safe_load((CHART / "files" / "kvmem.rules.yml").read_text()) == \
        yaml.safe_load(RULES.read_text())


# ------------------------------------------------------------------------- program invocations


def program_of(token):
    base = str(token).lstrip("-@:+!").rsplit("/", 1)[-1]
    return base if base in PROGRAMS else None


def container_invocations(docs, source):
    """(source, program, tokens) for every container, probe and flag file in YAML documents."""
    by_name = {"kvmemd": "kvmemd", "worker": "kvmem_worker"}

    def walk(node):
        if isinstance(node, dict):
            if "image" in node and "name" in node:
                tokens = list(node.get("command") or []) + list(node.get("args") or [])
                program = (program_of(tokens[0]) if node.get("command") else None) or \
                    by_name.get(node["name"])
                if program:
                    yield source, program, tokens
            if node.get("kind") == "ConfigMap":
                for key, value in (node.get("data") or {}).items():
                    if key.endswith(".flags"):
                        yield f"{source}:{key}", "kvmemd", value.split()
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            if node and isinstance(node[0], str) and program_of(node[0]):
                yield source, program_of(node[0]), node
            for value in node:
                yield from walk(value)

    for doc in docs:
        yield from walk(doc)


def systemd_invocations():
    env = {}
    for path in SYSTEMD.iterdir():
        text = path.read_text().replace("\\\n", " ")
        for line in text.splitlines():
            line = re.sub(r"^Environment=", "", line.strip())
            m = re.fullmatch(r"(\w+)=(.*)", line)
            if m and m.group(1).isupper():
                env[m.group(1)] = shlex.split(m.group(2))[0] if m.group(2) else ""
    for path in SYSTEMD.iterdir():
        for line in path.read_text().replace("\\\n", " ").splitlines():
            if line.startswith("ExecStart=") and line.strip() != "ExecStart=":
                tokens = []
                for token in shlex.split(line[len("ExecStart="):]):
                    var = re.fullmatch(r"\$\{?(\w+)\}?", token)
                    tokens += env.get(var.group(1), "").split() if var else [token]
                yield rel(path), program_of(tokens[0]), tokens


def dockerfile_instructions():
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines, heredoc = [], None
    for line in text.splitlines():
        if heredoc:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        m = re.search(r"<<-?[\"']?(\w+)[\"']?", line)
        heredoc = m.group(1) if m else None
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            lines.append((word.upper(), rest.strip()))
    return lines


def dockerfile_invocations():
    entry = None
    for word, rest in dockerfile_instructions():
        if word == "FROM":
            entry = None
        elif word == "ENTRYPOINT":
            entry = json.loads(rest)
            yield rel(DOCKERFILE), program_of(entry[0]), entry
        elif word == "CMD":
            yield rel(DOCKERFILE), program_of(entry[0]) if entry else None, json.loads(rest)
        elif word == "HEALTHCHECK":
            cmd = json.loads(rest.split(" CMD ", 1)[1])
            yield rel(DOCKERFILE), program_of(cmd[0]), cmd


def compose_invocations():
    for name, service in yaml.safe_load(COMPOSE.read_text())["services"].items():
        source = f"{rel(COMPOSE)}:{name}"
        entry = service.get("entrypoint")
        command = service.get("command") or []
        own_image = "build" in service or str(service.get("image", "")).startswith("kvmem:")
        if entry:
            yield source, program_of(entry[0]), list(entry) + list(command)
        elif own_image:  # the image's entrypoint: kvmemd
            yield source, "kvmemd", ["kvmemd"] + list(command)
        test = (service.get("healthcheck") or {}).get("test")
        if test and test[0] == "CMD":
            yield source, program_of(test[1]), test[1:]


def helm_invocations():
    for path in templates():
        text = path.read_text()
        bodies = blocks(text).values() if path.suffix == ".tpl" else [text]
        for body in bodies:
            docs = [d for d in yaml.safe_load_all(strip_template(body)) if d is not None]
            # A define body is a container list item, not a document.
            yield from container_invocations(docs if path.suffix != ".tpl" else [docs],
                                             rel(path))
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    source = rel(CHART / "values.yaml")
    yield source, "kvmemd", ["kvmemd"] + values["kvmemd"]["extraFlags"]
    worker = values["sidecar"]["worker"]
    yield source, program_of(worker["command"][0]), worker["command"] + worker["args"]


def invocations():
    yield from systemd_invocations()
    yield from dockerfile_invocations()
    yield from compose_invocations()
    for path in sorted(K8S.glob("*.yaml")):
        yield from container_invocations(load_all(path), rel(path))
    yield from helm_invocations()


def flags(tokens):
    return {t[2:].split("=", 1)[0] for t in tokens if isinstance(t, str) and t.startswith("--")}


def test_invocations_found_everywhere():
    """The extraction below sees kvmemd in every kind of file (it cannot pass by finding none)."""
    found = {(source.split(":")[0], program) for source, program, _ in invocations()}
    for source in ["deploy/systemd/kvmemd.service", "deploy/systemd/kvmemd-cuda.conf",
                   rel(DOCKERFILE), rel(COMPOSE), "deploy/k8s/sidecar.yaml",
                   "deploy/k8s/daemonset.yaml", "deploy/helm/kvmem/templates/_helpers.tpl",
                   "deploy/helm/kvmem/templates/configmap.yaml"]:
        assert (source, "kvmemd") in found, f"no kvmemd invocation found in {source}"
    assert (rel(COMPOSE), "kvmem_worker") in found
    assert ("deploy/k8s/sidecar.yaml", "kvmem_worker") in found
    assert ("deploy/k8s/sidecar.yaml", "kvmemctl") in found
    assert all(program for _, program, _ in invocations()), "an invocation of an unknown program"


def known_flags(program):
    binary = BIN / program
    if not binary.exists():
        pytest.skip(f"{binary} not built (set KVMEM_BIN to the build folder)")
    out = subprocess.run([binary, "--helpfull"], capture_output=True, text=True, timeout=30)
    text = out.stdout + out.stderr
    names = set(re.findall(r"^\s+--(\w+) ", text, re.M))
    assert "flagfile" in names, f"{binary} --helpfull printed no absl flag list"
    if program == "kvmemctl":  # its usage line lists the commands: "... info|stats|sequences"
        usage = text.splitlines()[0]
        return names, set(usage.split("]")[-1].strip().split("|"))
    return names, None


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_flags_exist(program):
    """Flags as absl defines them (underscores); a dashed spelling is not accepted here."""
    names, commands = known_flags(program)
    unknown = {}
    for source, prog, tokens in invocations():
        if prog != program:
            continue
        for flag in flags(tokens) - names:
            unknown.setdefault(flag, set()).add(source)
        if commands is not None:
            words = [t for t in tokens[1:] if not t.startswith("--")]
            assert len(words) == 1 and words[0] in commands, f"{source}: kvmemctl {words}"
    assert not unknown, f"{program} has no such flags: " + "; ".join(
        f"--{f} ({', '.join(sorted(s))})" for f, s in sorted(unknown.items()))


# ------------------------------------------------------------------------- Dockerfile, compose


def ignored(path, patterns):
    parts = Path(path).parts
    for i in range(1, len(parts) + 1):
        prefix = "/".join(parts[:i])
        for p in patterns:
            if fnmatch.fnmatch(prefix, p) or (p.startswith("**/") and fnmatch.fnmatch(parts[i - 1], p[3:])):
                return True
    return False


def test_dockerfile_copies_and_targets():
    patterns = [l.strip() for l in (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().splitlines()
                if l.strip() and not l.startswith("#")]
    stages, built = set(), set()
    for word, rest in dockerfile_instructions():
        if word == "FROM":
            m = re.search(r"\s+AS\s+(\S+)", rest, re.I)
            stages.add(m.group(1) if m else None)
        if word in ("COPY", "ADD"):
            args = [a for a in shlex.split(rest) if not a.startswith("--")]
            if "--from=" in rest:
                assert rest.split("--from=")[1].split()[0] in stages, f"unknown stage: {rest}"
                continue
            if "<<" in rest:
                continue
            for src in args[:-1]:
                if src.startswith(("http://", "https://", "$")):
                    continue
                assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
                assert not ignored(src, patterns), f"COPY {src}: excluded by Dockerfile.dockerignore"
        if word == "RUN":
            built |= set(re.findall(r"--target ([\w ]+?)(?: \\|$| &&)", rest)[0].split()) \
                if "--target" in rest else set()
    assert {"runtime", "runtime-cuda"} <= stages
    cmake = (ROOT / "CMakeLists.txt").read_text()
    assert built, "no cmake --build --target found"
    for target in built:
        assert re.search(rf"add_executable\({re.escape(target)}\s", cmake), f"no CMake target {target}"
    compose_target = yaml.safe_load(COMPOSE.read_text())["services"]["kvmemd"]["build"]["target"]
    assert compose_target in stages


def test_compose_paths_and_wiring():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    for name, service in services.items():
        build = service.get("build")
        if build:
            context = (DEPLOY / build["context"]).resolve()
            assert (context / build["dockerfile"]).is_file(), f"{name}: no {build['dockerfile']}"
        for volume in service.get("volumes", []):
            src = volume.split(":")[0]
            if src.startswith(".") and "$" not in src:
                assert (DEPLOY / src).exists(), f"{name} mounts {src}, which does not exist"
            elif not src.startswith(("/", "$")):
                assert src in compose["volumes"], f"{name}: undeclared volume {src}"
    kvmemd = services["kvmemd"]
    listen = next(t for t in kvmemd["command"] if t.startswith("--listen="))[len("--listen="):]
    worker_target = next(t for t in services["worker"]["entrypoint"] if t.startswith("--target="))
    assert worker_target == f"--target={listen}"
    # The pool's descriptor comes through the attach socket in the socket volume.
    assert "ipc" not in kvmemd and "ipc" not in services["worker"] and "shm_size" not in kvmemd
    socket_dir = str(Path(listen.removeprefix("unix:")).parent)
    for name in ("kvmemd", "worker"):
        assert any(v.split(":")[1] == socket_dir for v in services[name]["volumes"]), name
    metrics = next(t for t in kvmemd["command"] if t.startswith("--metrics_listen="))
    assert metrics.startswith("--metrics_listen=0.0.0.0:"), "Prometheus scrapes kvmemd over the network"


# ------------------------------------------------------------------------- Kubernetes


QUANTITY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "": 1}


def quantity(text):
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|)", str(text))
    assert m, f"quantity {text}"
    return int(m.group(1)) * QUANTITY[m.group(2)]


def workload(path):
    docs = load_all(path)
    flagfiles = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    pod = next(d for d in docs if d["kind"] in ("Deployment", "DaemonSet"))["spec"]["template"]
    return pod, flagfiles


def cpu_flag_sets():
    """The kvmemd flag sets of the CPU deployments: compose's command and the sidecar's file."""
    for source, program, tokens in compose_invocations():
        if program == "kvmemd":
            yield source, [t for t in tokens[1:] if t.startswith("--")]
    pod, flagfiles = workload(K8S / "sidecar.yaml")
    for files in flagfiles.values():
        for name, text in files.items():
            yield f"deploy/k8s/sidecar.yaml:{name}", text.split()


@pytest.mark.parametrize("source,tokens", list(cpu_flag_sets()), ids=lambda v: str(v)[:40])
def test_kvmemd_starts_with_the_deploy_flags(source, tokens, tmp_path):
    """Each CPU deployment's flags start kvmemd (its own bounds agree with each other: a limit
    one flag sets may not be below what another needs), on a socket of the test's own."""
    binary = BIN / "kvmemd"
    if not binary.exists():
        pytest.skip(f"{binary} not built (set KVMEM_BIN to the build folder)")
    kept = [t for t in tokens if not t.startswith(("--listen=", "--metrics_listen="))]
    proc = subprocess.Popen(
        [str(binary), *kept, f"--listen=unix:{tmp_path}/kvmemd.sock", "--metrics_listen=",
         "--pool_prefault=false"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), f"{source}: kvmemd did not start: {proc.stderr.read()}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("name", ["sidecar.yaml", "daemonset.yaml"])
def test_k8s_workload(name):
    pod, flagfiles = workload(K8S / name)
    spec = pod["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    containers = spec.get("initContainers", []) + spec["containers"]
    for c in containers:
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert "ALL" in sc["capabilities"]["drop"], c["name"]
        if sc.get("runAsUser") == 0:  # only to chown a hostPath, with nothing but CHOWN/FOWNER
            assert set(sc["capabilities"].get("add", [])) <= {"CHOWN", "FOWNER"}
            assert "chown" in " ".join(c["command"])
        assert "memory" in c["resources"]["limits"], c["name"]
        for m in c.get("volumeMounts", []):
            assert m["name"] in volumes, f"{c['name']} mounts undeclared volume {m['name']}"
    kvmemd = next(c for c in containers if c["name"] == "kvmemd")
    flagfile = next(a for a in kvmemd["args"] if a.startswith("--flagfile="))[len("--flagfile="):]
    mount = next(m for m in kvmemd["volumeMounts"] if flagfile.startswith(m["mountPath"] + "/"))
    cm = volumes[mount["name"]]["configMap"]["name"]
    values = dict(t[2:].split("=", 1) for t in flagfiles[cm][Path(flagfile).name].split())
    socket = values["listen"].removeprefix("unix:")
    socket_volume = next(m["name"] for m in kvmemd["volumeMounts"] if m["mountPath"] == str(Path(socket).parent))
    assert values["metrics_listen"] == f"0.0.0.0:{kvmemd['ports'][0]['containerPort']}"
    # The segments have no names (memfds handed out by descriptor): nothing mounts /dev/shm.
    for c in containers:
        assert all(m["mountPath"] != "/dev/shm" for m in c.get("volumeMounts", [])), c["name"]
    # kvmemd's memory limit holds every bound its flags set: the pool (host memory on the
    # CPU backend), host metadata, gRPC's buffers and the requests being served once parsed.
    pool = int(values["pool_bytes"])
    bounds = (int(values.get("host_metadata_bytes", pool // 2 + (64 << 20)))
              + int(values.get("grpc_memory_bytes", 1 << 30))
              + int(values.get("parse_memory_bytes", 1 << 30)))
    if values["backend"] == "cpu":
        bounds += pool
    assert quantity(kvmemd["resources"]["limits"]["memory"]) >= bounds, (name, bounds)
    probe = kvmemd["readinessProbe"]["exec"]["command"]
    assert f"--target={values['listen']}" in probe
    if name == "sidecar.yaml":
        assert kvmemd.get("restartPolicy") == "Always", "kvmemd is a native sidecar"
        assert values["backend"] == "cpu"
        worker = next(c for c in containers if c["name"] == "worker")
        assert f"--target={values['listen']}" in worker["command"]
        assert socket_volume in {m["name"] for m in worker["volumeMounts"]}
    else:
        assert values["backend"] == "cuda"
        assert kvmemd["resources"]["limits"]["nvidia.com/gpu"] >= 1
        assert volumes[socket_volume]["hostPath"]["path"] == str(Path(socket).parent)


def test_k8s_service_and_servicemonitor_select():
    service = load_all(K8S / "service.yaml")[0]
    monitor = load_all(K8S / "servicemonitor.yaml")[0]
    port = service["spec"]["ports"][0]
    for name in ("sidecar.yaml", "daemonset.yaml"):
        pod, _ = workload(K8S / name)
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items(), name
        kvmemd = next(c for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]
                      if c["name"] == "kvmemd")
        assert port["targetPort"] in {p["name"] for p in kvmemd["ports"]}
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == port["name"]


# ------------------------------------------------------------------------- rules


def rule_groups():
    return load_all(K8S / "prometheusrule.yaml")[0]["spec"]["groups"]


def rules_by_name(groups):
    out = {}
    for group in groups:
        for rule in group["rules"]:
            name = rule.get("alert") or rule["record"]
            out[name] = {k: " ".join(str(rule.get(k, "")).split()) for k in ("expr", "for", "labels")}
    return out


def test_prometheusrule_matches_rules_file():
    mine = rules_by_name(rule_groups())
    assert ALERTS <= mine.keys()
    if not RULES.exists():
        pytest.skip(f"{rel(RULES)} not written yet")
    theirs = rules_by_name(yaml.safe_load(RULES.read_text())["groups"])
    assert mine.keys() == theirs.keys(), "rule names differ"
    for name in mine:
        assert mine[name] == theirs[name], f"{name} differs between the PrometheusRule and {rel(RULES)}"


def test_prometheusrule_passes_promtool(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus)")
    rules = tmp_path / RULES.name
    rules.write_text(yaml.safe_dump({"groups": rule_groups()}))
    out = subprocess.run([promtool, "check", "rules", rules], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    if RULES_TEST.exists():  # the rules file's own unit tests, run against this copy
        shutil.copy(RULES_TEST, tmp_path)
        out = subprocess.run([promtool, "test", "rules", RULES_TEST.name], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr


# ------------------------------------------------------------------------- systemd, README


def test_systemd_unit_verifies(tmp_path):
    unit = (SYSTEMD / "kvmemd.service").read_text()
    for setting in ["ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
                    "NoNewPrivileges=yes", "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6",
                    "SystemCallFilter=@system-service", "RuntimeDirectory=kvmem",
                    "--listen=unix:/run/kvmem/", "--metrics_listen=127.0.0.1:9464"]:
        assert setting in unit, setting
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed")
    exe = BIN / "kvmemd" if (BIN / "kvmemd").exists() else Path(shutil.which("true"))
    (tmp_path / "kvmemd.service").write_text(unit.replace("/usr/local/bin/kvmemd", str(exe)))
    (tmp_path / "kvmemd.service.d").mkdir()
    (tmp_path / "kvmemd.service.d" / "cuda.conf").write_text(
        (SYSTEMD / "kvmemd-cuda.conf").read_text().replace("/usr/local/bin/kvmemd", str(exe)))
    out = subprocess.run([analyze, "verify", "kvmemd.service"], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, SYSTEMD_UNIT_PATH=f"{tmp_path}:"))
    complaints = [l for l in (out.stdout + out.stderr).splitlines() if str(tmp_path) in l]
    assert out.returncode == 0 and not complaints, out.stdout + out.stderr


def test_readme_names_every_file():
    readme = (DEPLOY / "README.md").read_text()
    for path in sorted(DEPLOY.rglob("*")):
        parts = path.relative_to(DEPLOY).parts
        if path.is_file() and parts[0] not in FOREIGN and path.name != "README.md":
            assert str(path.relative_to(DEPLOY)) in readme, f"README.md does not mention {parts}"
