//! deploy/ cannot be run here (no Docker, no cluster), so this checks what can be
//! checked: every YAML file parses, the manifests hang together (labels, ports, probes,
//! resources), every MAILROOM_* variable they set is a real setting of the binary (as
//! `mailroom --help` lists them), the ConfigMap's values pass the binary's own
//! validation, and the Dockerfile builds and runs the binary it names.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_yaml::Value;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy")
}

fn yaml_docs(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| {
            Value::deserialize(d)
                .unwrap_or_else(|e| panic!("{} does not parse: {e}", path.display()))
        })
        .filter(|v| !v.is_null())
        .collect()
}

use serde::Deserialize;

fn manifests() -> BTreeMap<String, Value> {
    let mut docs = Vec::new();
    for entry in std::fs::read_dir(deploy_dir().join("k8s")).unwrap() {
        let p = entry.unwrap().path();
        let kustomization = p.file_name().is_some_and(|n| n == "kustomization.yaml");
        if !kustomization && p.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            docs.extend(yaml_docs(&p));
        }
    }
    by_kind(docs)
}

/// Objects by kind (one of each in these manifests).
fn by_kind(docs: Vec<Value>) -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    for doc in docs {
        let kind = doc["kind"]
            .as_str()
            .expect("every manifest has a kind")
            .to_string();
        assert!(out.insert(kind.clone(), doc).is_none(), "two {kind}s");
    }
    out
}

/// MAILROOM_* names the binary knows, from `mailroom --help`.
fn known_env() -> BTreeSet<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_mailroom"))
        .arg("--help")
        .env_clear()
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    let mut names = BTreeSet::new();
    for part in help.split("[env: ").skip(1) {
        let name: String = part
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        names.insert(name);
    }
    assert!(names.contains("MAILROOM_DATABASE_URL"), "{help}");
    names
}

fn port_of(addr: &str) -> u16 {
    addr.rsplit(':').next().unwrap().parse().unwrap()
}

fn s(v: &Value) -> &str {
    v.as_str()
        .unwrap_or_else(|| panic!("expected a string, got {v:?}"))
}

#[test]
fn kubernetes_manifests_hang_together() {
    hang_together(&manifests());
}

/// Labels, selectors, ports, probes, settings and resources agree across the objects.
fn hang_together(m: &BTreeMap<String, Value>) {
    for kind in ["Deployment", "Service", "ConfigMap", "PodDisruptionBudget"] {
        assert!(m.contains_key(kind), "deploy/k8s has no {kind}");
    }
    let known = known_env();
    let cm = &m["ConfigMap"]["data"];
    let data: BTreeMap<String, String> = cm
        .as_mapping()
        .unwrap()
        .iter()
        .map(|(k, v)| (s(k).to_string(), s(v).to_string()))
        .collect();
    for k in data.keys().filter(|k| k.starts_with("MAILROOM_")) {
        assert!(
            known.contains(k),
            "ConfigMap sets {k}, which mailroom does not know"
        );
    }
    let grpc_port = port_of(&data["MAILROOM_LISTEN"]);
    let metrics_port = port_of(&data["MAILROOM_METRICS_LISTEN"]);

    let d = &m["Deployment"];
    let labels = &d["spec"]["template"]["metadata"]["labels"];
    assert_eq!(&d["spec"]["selector"]["matchLabels"], labels);
    let pod = &d["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    for e in c["env"].as_sequence().unwrap() {
        let name = s(&e["name"]);
        if name.starts_with("MAILROOM_") {
            assert!(
                known.contains(name),
                "Deployment sets {name}, unknown to mailroom"
            );
        }
    }
    if let Some(args) = c["args"].as_sequence() {
        for a in args {
            assert!(
                ["serve", "migrate"].contains(&s(a)),
                "unknown subcommand {a:?}"
            );
        }
    }
    let ports: BTreeMap<String, u16> = c["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|p| {
            (
                s(&p["name"]).to_string(),
                p["containerPort"].as_u64().unwrap() as u16,
            )
        })
        .collect();
    assert_eq!(
        ports["grpc"], grpc_port,
        "containerPort grpc vs MAILROOM_LISTEN"
    );
    assert_eq!(ports["metrics"], metrics_port);
    for probe in ["readinessProbe", "livenessProbe"] {
        let p = &c[probe]["grpc"];
        assert_eq!(
            p["port"].as_u64(),
            Some(u64::from(grpc_port)),
            "{probe} is a native gRPC probe on the gRPC port"
        );
    }
    // Liveness must not follow the database: it uses the service that stays SERVING.
    assert_eq!(
        s(&c["livenessProbe"]["grpc"]["service"]),
        mailroom::health::LIVENESS
    );
    assert!(c["resources"]["requests"]["cpu"].as_str().is_some());
    assert!(c["resources"]["requests"]["memory"].as_str().is_some());
    // The token file the ConfigMap names is mounted.
    if let Some(tokens) = data.get("MAILROOM_TOKENS_FILE") {
        let dir = Path::new(tokens).parent().unwrap().to_str().unwrap();
        assert!(
            c["volumeMounts"]
                .as_sequence()
                .unwrap()
                .iter()
                .any(|v| s(&v["mountPath"]) == dir),
            "{tokens} is not mounted"
        );
    }
    // The grace period outlasts mailroom's own.
    let grace_ms: u64 = data["MAILROOM_SHUTDOWN_GRACE_MS"].parse().unwrap();
    assert!(pod["terminationGracePeriodSeconds"].as_u64().unwrap() * 1000 > grace_ms);

    let svc = &m["Service"]["spec"];
    assert_eq!(&svc["selector"], labels);
    for p in svc["ports"].as_sequence().unwrap() {
        let target = &p["targetPort"];
        let ok = match target.as_str() {
            Some(name) => ports.contains_key(name),
            None => ports
                .values()
                .any(|v| Some(u64::from(*v)) == target.as_u64()),
        };
        assert!(ok, "Service targetPort {target:?} is not a container port");
    }
    let pdb = &m["PodDisruptionBudget"]["spec"];
    assert_eq!(&pdb["selector"]["matchLabels"], labels);
    let replicas = d["spec"]["replicas"].as_u64().unwrap();
    assert!(pdb["minAvailable"].as_u64().unwrap() < replicas);
}

/// The safe upgrade is the default (issue 24, item 1): replicas do not migrate at
/// start-up, and a Job outside `deploy/k8s/` itself (so that applying the directory does
/// not start it beside a rollout) runs `mailroom migrate` with the Deployment's image,
/// settings and database secret, as hardened as the pods.
#[test]
fn migrations_run_once_from_a_job_and_replicas_do_not_migrate() {
    let m = manifests();
    assert_eq!(s(&m["ConfigMap"]["data"]["MAILROOM_MIGRATE"]), "false");
    assert!(
        !m.contains_key("Job"),
        "the Job lives in deploy/k8s/migrate/"
    );
    let docs = yaml_docs(&deploy_dir().join("k8s/migrate/job.yaml"));
    let job = &docs[0];
    assert_eq!(s(&job["kind"]), "Job");
    let pod = &job["spec"]["template"]["spec"];
    assert_eq!(s(&pod["restartPolicy"]), "Never");
    let c = &pod["containers"][0];
    let d = &m["Deployment"]["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(c["args"].as_sequence().unwrap().len(), 1);
    assert_eq!(s(&c["args"][0]), "migrate");
    assert_eq!(
        c["image"], d["image"],
        "the Job migrates for the release it precedes"
    );
    assert_eq!(
        c["envFrom"][0]["configMapRef"]["name"], d["envFrom"][0]["configMapRef"]["name"],
        "the Deployment's settings"
    );
    let url = |c: &Value| {
        c["env"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|e| s(&e["name"]) == "MAILROOM_DATABASE_URL_FILE")
            .cloned()
            .expect("MAILROOM_DATABASE_URL_FILE, a file from the Secret")
    };
    assert_eq!(url(c), url(d));
    assert_eq!(
        c["volumeMounts"], d["volumeMounts"],
        "the token file the ConfigMap names"
    );
    assert_eq!(
        pod["securityContext"],
        m["Deployment"]["spec"]["template"]["spec"]["securityContext"]
    );
    assert_eq!(c["securityContext"], d["securityContext"]);
    let known = known_env();
    for e in c["env"].as_sequence().unwrap() {
        assert!(known.contains(s(&e["name"])), "{e:?}");
    }
}

/// The ConfigMap's settings pass mailroom's validation: started with them (and a
/// database that refuses), it fails connecting (exit 1), not on a setting (exit 64).
#[test]
fn the_configmap_settings_are_valid() {
    let m = manifests();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_mailroom"));
    cmd.env_clear();
    for (k, v) in m["ConfigMap"]["data"].as_mapping().unwrap() {
        cmd.env(s(k), s(v));
    }
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens.toml");
    std::fs::write(
        &tokens,
        "[[token]]\nname = \"p\"\ntoken = \"0123456789abcdef0123\"\nscopes = [\"enqueue\"]\n",
    )
    .unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    cmd.env("MAILROOM_TOKENS_FILE", &tokens)
        .env(
            "MAILROOM_DATABASE_URL",
            format!("postgres://mailroom@127.0.0.1:{port}/mailroom"),
        )
        .env("MAILROOM_LISTEN", "127.0.0.1:0")
        .env("MAILROOM_METRICS_LISTEN", "127.0.0.1:0")
        .env("MAILROOM_DATABASE_ACQUIRE_TIMEOUT_MS", "500");
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("invalid setting"), "{stderr}");
    assert!(stderr.contains("connecting to"), "{stderr}");
}

#[test]
fn compose_file_parses_and_uses_real_settings() {
    let docs = yaml_docs(&deploy_dir().join("docker-compose.yml"));
    let compose = &docs[0];
    let services = compose["services"].as_mapping().unwrap();
    for name in ["postgres", "kafka", "mailroom"] {
        assert!(services.contains_key(name), "compose has no {name} service");
    }
    let known = known_env();
    let m = &compose["services"]["mailroom"];
    let env = m["environment"].as_mapping().unwrap();
    for (k, v) in env {
        let k = s(k);
        if k.starts_with("MAILROOM_") {
            assert!(known.contains(k), "compose sets {k}, unknown to mailroom");
        }
        if k == "MAILROOM_LISTEN" || k == "MAILROOM_METRICS_LISTEN" {
            let port = port_of(s(v));
            assert!(
                m["ports"]
                    .as_sequence()
                    .unwrap()
                    .iter()
                    .any(|p| s(p).ends_with(&format!(":{port}"))),
                "{k} port {port} is not published"
            );
        }
    }
    let brokers = s(&env[&Value::from("MAILROOM_KAFKA_BROKERS")]);
    assert!(brokers.starts_with("kafka:"), "{brokers}");
    let db = s(&env[&Value::from("MAILROOM_DATABASE_URL")]);
    assert!(db.contains("@postgres:5432/"), "{db}");
    assert_eq!(
        s(&m["build"]["dockerfile"]),
        "deploy/Dockerfile",
        "compose builds the Dockerfile in deploy/"
    );
}

#[test]
fn dockerfile_is_multi_stage_and_runs_the_binary() {
    let text = std::fs::read_to_string(deploy_dir().join("Dockerfile")).unwrap();
    let froms: Vec<&str> = text
        .lines()
        .filter(|l| l.trim_start().to_ascii_uppercase().starts_with("FROM "))
        .collect();
    assert!(froms.len() >= 2, "multi-stage: {froms:?}");
    assert!(
        froms.last().unwrap().contains("slim"),
        "small runtime image: {froms:?}"
    );
    assert!(text.contains("cargo build --release --locked --bin mailroom"));
    assert!(text.contains("ENTRYPOINT [\"/usr/local/bin/mailroom\"]"));
    let known = known_env();
    for word in text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        if word.starts_with("MAILROOM_") {
            assert!(
                known.contains(word),
                "Dockerfile sets {word}, unknown to mailroom"
            );
        }
    }
    let exposed: BTreeSet<u16> = text
        .lines()
        .filter_map(|l| l.strip_prefix("EXPOSE "))
        .flat_map(|l| l.split_whitespace().map(|p| p.parse::<u16>().unwrap()))
        .collect();
    assert!(
        exposed.contains(&50051) && exposed.contains(&9090),
        "{exposed:?}"
    );
    assert!(text.contains("MAILROOM_LISTEN=0.0.0.0:50051"));
    assert!(text.contains("MAILROOM_METRICS_LISTEN=0.0.0.0:9090"));
}

/// Issue 12 §1 and §5: the shipped deployments are closed and hardened. Tokens come from
/// a secret everywhere; the pod cannot gain privileges, write its root filesystem or keep
/// a capability; a long migration is covered by a startup probe; no image is `latest`;
/// the build context leaves out secrets and build output.
#[test]
fn deployments_ship_closed_and_hardened() {
    let m = manifests();
    let pod = &m["Deployment"]["spec"]["template"]["spec"];
    assert_eq!(
        s(&pod["securityContext"]["seccompProfile"]["type"]),
        "RuntimeDefault"
    );
    assert_eq!(pod["securityContext"]["runAsNonRoot"].as_bool(), Some(true));
    let c = &pod["containers"][0];
    let sc = &c["securityContext"];
    assert_eq!(sc["allowPrivilegeEscalation"].as_bool(), Some(false));
    assert_eq!(sc["readOnlyRootFilesystem"].as_bool(), Some(true));
    let drop: Vec<&str> = sc["capabilities"]["drop"]
        .as_sequence()
        .expect("capabilities.drop")
        .iter()
        .map(s)
        .collect();
    assert_eq!(drop, ["ALL"]);
    let startup = &c["startupProbe"];
    assert!(startup.is_mapping(), "a startup probe");
    assert!(
        startup["periodSeconds"].as_u64().unwrap() * startup["failureThreshold"].as_u64().unwrap()
            >= 300,
        "the startup probe allows a long migration"
    );
    // Tokens: the ConfigMap names the file, the file is a Secret volume.
    let tokens_file = s(&m["ConfigMap"]["data"]["MAILROOM_TOKENS_FILE"]);
    let mount = c["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| tokens_file.starts_with(s(&v["mountPath"])))
        .expect("the token file is mounted");
    let volume = pod["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    assert!(volume["secret"]["secretName"].is_string(), "{volume:?}");
    // No `latest` (or untagged) image anywhere.
    let compose = &yaml_docs(&deploy_dir().join("docker-compose.yml"))[0];
    let mut images = vec![s(&c["image"]).to_string()];
    for (_, svc) in compose["services"].as_mapping().unwrap() {
        if let Some(i) = svc["image"].as_str() {
            images.push(i.to_string());
        }
    }
    for i in &images {
        let tag = i.rsplit_once(':').map(|(_, t)| t).unwrap_or("");
        assert!(
            !tag.is_empty() && tag != "latest",
            "image {i} has no pinned tag"
        );
    }
    // compose: the token file is a secret, the container read-only without capabilities.
    let mr = &compose["services"]["mailroom"];
    assert_eq!(
        s(&mr["environment"]["MAILROOM_TOKENS_FILE"]),
        "/run/secrets/mailroom-tokens"
    );
    assert!(
        mr["secrets"]
            .as_sequence()
            .unwrap()
            .iter()
            .any(|x| s(x) == "mailroom-tokens")
    );
    assert!(compose["secrets"]["mailroom-tokens"]["file"].is_string());
    assert_eq!(mr["read_only"].as_bool(), Some(true));
    // The image: a token file from a secret by default.
    let dockerfile = std::fs::read_to_string(deploy_dir().join("Dockerfile")).unwrap();
    assert!(dockerfile.contains("MAILROOM_TOKENS_FILE=/run/secrets/mailroom-tokens"));
    // .dockerignore keeps build output, git data and secrets out of the context.
    let ignore = std::fs::read_to_string(deploy_dir().join("../.dockerignore")).unwrap();
    for must in [
        "target/",
        ".git/",
        "deploy/secrets/",
        "**/tokens*.toml",
        "**/*.db",
    ] {
        assert!(
            ignore.lines().any(|l| l.trim() == must),
            ".dockerignore lacks {must}"
        );
    }
}

/// The image's defaults (listen on all interfaces, a token file path) refuse to start
/// when the token secret is missing, and start with it: closed by default.
#[test]
fn the_image_defaults_refuse_to_serve_without_tokens() {
    let run = |extra: &[(&str, &str)]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_mailroom"));
        cmd.env_clear()
            .env("MAILROOM_LISTEN", "0.0.0.0:0")
            .env("MAILROOM_DATABASE_URL", "sqlite::memory:");
        for (k, v) in extra {
            cmd.env(k, v);
        }
        cmd.arg("serve");
        let mut child = cmd
            .stderr(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
        while std::time::Instant::now() < deadline {
            if child.try_wait().unwrap().is_some() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let _ = child.kill();
        let out = child.wait_with_output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let (code, stderr) = run(&[]);
    assert_eq!(code, Some(64), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "one clear line: {stderr}");
    assert!(stderr.contains("--allow-unauthenticated"), "{stderr}");
    // Explicitly open: starts, with a warning.
    let (code, stderr) = run(&[("MAILROOM_ALLOW_UNAUTHENTICATED", "true")]);
    assert_eq!(code, None, "still running when killed: {stderr}");
    assert!(stderr.contains("allow-unauthenticated"), "warned: {stderr}");
}

/// Issue 25, item 4: the Deployment's memory limit covers the byte budgets its settings
/// give: about 64 MiB for the process, plus twice the request bytes in flight
/// (`MAILROOM_MAX_REQUEST_BYTES_IN_FLIGHT`, default twice `MAILROOM_MAX_BATCH_BYTES`):
/// each admitted request is held encoded while it is decoded. (Measured: eight
/// concurrent 60 MiB batches peak at ~270 MiB with the default budget of 128 MiB,
/// `byte_budgets::concurrent_large_batches_are_admitted_by_bytes`.)
#[test]
fn the_pod_memory_limit_covers_the_byte_budgets() {
    memory_covers_budgets(&manifests());
}

fn memory_covers_budgets(m: &BTreeMap<String, Value>) {
    const MIB: u64 = 1024 * 1024;
    let setting = |name: &str| -> Option<u64> {
        m["ConfigMap"]["data"]
            .as_mapping()
            .unwrap()
            .iter()
            .find(|(k, _)| s(k) == name)
            .map(|(_, v)| s(v).parse().expect("a number of bytes"))
    };
    let batch = setting("MAILROOM_MAX_BATCH_BYTES").unwrap_or(64 * MIB);
    let in_flight = setting("MAILROOM_MAX_REQUEST_BYTES_IN_FLIGHT").unwrap_or(2 * batch);
    assert!(
        in_flight > 0,
        "the shipped settings keep the byte budget on"
    );
    let container = &m["Deployment"]["spec"]["template"]["spec"]["containers"][0];
    let limit = s(&container["resources"]["limits"]["memory"]);
    let limit: u64 = match limit.strip_suffix("Mi") {
        Some(n) => n.parse::<u64>().unwrap() * MIB,
        None => limit.strip_suffix("Gi").unwrap().parse::<u64>().unwrap() * 1024 * MIB,
    };
    let needed = 64 * MIB + 2 * in_flight;
    assert!(
        needed <= limit,
        "the pod's {} MiB limit is below the {} MiB the settings allow",
        limit / MIB,
        needed / MIB
    );
}

/// Issue 25, item 5: the manifests hand secrets to the pods as files from the Secret,
/// never as environment variables (which `kubectl describe` and `/proc/<pid>/environ`
/// show), through settings the binary knows.
#[test]
fn secrets_reach_the_pods_as_files_only() {
    let m = manifests();
    let job = yaml_docs(&deploy_dir().join("k8s/migrate/job.yaml")).remove(0);
    let known = known_env();
    for (what, pod) in [
        ("Deployment", &m["Deployment"]["spec"]["template"]["spec"]),
        ("Job", &job["spec"]["template"]["spec"]),
    ] {
        let c = &pod["containers"][0];
        for e in c["env"].as_sequence().unwrap() {
            assert!(
                e["valueFrom"]["secretKeyRef"].is_null(),
                "{what}: {} comes from a Secret as a variable",
                s(&e["name"])
            );
            assert!(known.contains(s(&e["name"])), "{what}: {e:?}");
        }
        let files: Vec<&str> = pod["volumes"][0]["secret"]["items"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|i| s(&i["path"]))
            .collect();
        assert!(files.contains(&"database-url"), "{what}: {files:?}");
    }
}

/// Issue 25, item 5: a NetworkPolicy ships with the manifests. It selects the
/// Deployment's pods, admits gRPC only from labelled clients and `/metrics` (no
/// authentication) only from the monitoring namespace, and opens no other port.
#[test]
fn a_network_policy_guards_grpc_and_metrics() {
    network_policy_guards(&manifests());
}

fn network_policy_guards(m: &BTreeMap<String, Value>) {
    let np = &m["NetworkPolicy"];
    let pods = &m["Deployment"]["spec"]["template"]["metadata"]["labels"];
    for (k, v) in np["spec"]["podSelector"]["matchLabels"]
        .as_mapping()
        .unwrap()
    {
        assert_eq!(&pods[k], v, "the policy selects the Deployment's pods");
    }
    assert_eq!(
        np["spec"]["policyTypes"].as_sequence().unwrap(),
        &[Value::from("Ingress")]
    );
    let rules = np["spec"]["ingress"].as_sequence().unwrap();
    let mut ports = Vec::new();
    for r in rules {
        assert!(
            !r["from"].as_sequence().unwrap().is_empty(),
            "every rule names its sources: {r:?}"
        );
        for p in r["ports"].as_sequence().unwrap() {
            ports.push(p["port"].as_u64().unwrap());
        }
    }
    ports.sort();
    assert_eq!(ports, [9090, 50051]);
    let metrics = rules
        .iter()
        .find(|r| r["ports"][0]["port"].as_u64() == Some(9090))
        .unwrap();
    assert!(
        metrics["from"]
            .as_sequence()
            .unwrap()
            .iter()
            .all(|f| f["podSelector"].is_null() && !f["namespaceSelector"].is_null()),
        "metrics only from a namespace: {metrics:?}"
    );
}

/// `DIR` rendered as `kubectl kustomize DIR` would, by `render` below: the subset of
/// kustomize these files use, so that the suite needs no kubectl (Debian's 1.20 cannot
/// render components). Where a kubectl that renders is installed, its output must be
/// the same objects (a renderer that drifted from kustomize fails here).
fn kustomize(dir: &str) -> Vec<Value> {
    let path = deploy_dir().join(dir);
    let mut ours = render(&path);
    match Command::new("kubectl").arg("kustomize").arg(&path).output() {
        Ok(out) if out.status.success() => {
            let text = String::from_utf8(out.stdout).unwrap();
            let mut theirs: Vec<Value> = serde_yaml::Deserializer::from_str(&text)
                .map(|d| Value::deserialize(d).unwrap())
                .filter(|v| !v.is_null())
                .collect();
            let key = |v: &Value| format!("{}/{}", s(&v["kind"]), s(&v["metadata"]["name"]));
            ours.sort_by_key(key);
            theirs.sort_by_key(key);
            assert_eq!(
                ours, theirs,
                "{dir}: the renderer and kubectl kustomize differ"
            );
        }
        _ => println!("{dir}: no kubectl that renders kustomizations here; rendered without it"),
    }
    ours
}

/// The kustomization in `dir`: its resources (files, or directories rendered in turn),
/// components, then `namespace`, `images`, `replicas` and JSON 6902 `patches`, which is
/// all these files use (anything else is refused, not ignored).
fn render(dir: &Path) -> Vec<Value> {
    let k = &yaml_docs(&dir.join("kustomization.yaml"))[0];
    for field in k.as_mapping().unwrap().keys() {
        assert!(
            [
                "apiVersion",
                "kind",
                "resources",
                "components",
                "namespace",
                "images",
                "replicas",
                "patches"
            ]
            .contains(&s(field)),
            "{dir:?}: the renderer does not know `{}`",
            s(field)
        );
    }
    let mut objects = Vec::new();
    let list = |f: &str| k[f].as_sequence().cloned().unwrap_or_default();
    for entry in list("resources").iter().chain(list("components").iter()) {
        let p = dir.join(s(entry));
        if p.is_dir() {
            objects.extend(render(&p));
        } else {
            objects.extend(yaml_docs(&p));
        }
    }
    for o in &mut objects {
        if let Some(ns) = k["namespace"].as_str() {
            o["metadata"]
                .as_mapping_mut()
                .unwrap()
                .insert("namespace".into(), ns.into());
        }
        for image in list("images") {
            let Some(spec) = o
                .get_mut("spec")
                .and_then(|v| v.get_mut("template"))
                .and_then(|v| v.get_mut("spec"))
            else {
                continue;
            };
            for group in ["containers", "initContainers"] {
                let Some(cs) = spec.get_mut(group).and_then(Value::as_sequence_mut) else {
                    continue;
                };
                for c in cs {
                    let name = c["image"].as_str().and_then(|i| i.split(':').next());
                    if name.is_some() && name == image["name"].as_str() {
                        c["image"] =
                            format!("{}:{}", s(&image["newName"]), s(&image["newTag"])).into();
                    }
                }
            }
        }
        for r in list("replicas") {
            if o["metadata"]["name"] == r["name"] && o["spec"].get("replicas").is_some() {
                o["spec"]["replicas"] = r["count"].clone();
            }
        }
        for patch in list("patches") {
            let t = &patch["target"];
            if o["kind"] != t["kind"] || o["metadata"]["name"] != t["name"] {
                continue;
            }
            let ops: Vec<Value> = serde_yaml::from_str(s(&patch["patch"])).unwrap();
            for op in ops {
                assert_eq!(s(&op["op"]), "replace", "the renderer knows `replace` only");
                let mut at = &mut *o;
                for step in s(&op["path"]).trim_start_matches('/').split('/') {
                    at = match step.parse::<usize>() {
                        Ok(i) => &mut at[i],
                        Err(_) => &mut at[step],
                    };
                }
                assert!(
                    !at.is_null(),
                    "{dir:?}: {} replaces nothing",
                    s(&op["path"])
                );
                *at = op["value"].clone();
            }
        }
    }
    objects
}

/// Issue 28, item 4: the kustomize base (`deploy/k8s`) and its overlays render, and the
/// rendered objects pass the same checks as the plain manifests (labels, ports, native
/// gRPC probes, PodDisruptionBudget below the replicas, memory over the byte budgets,
/// the NetworkPolicy). Each overlay puts every object in its namespace, its migration
/// Job (`migrate/`, applied first) runs the Deployment's image in the same namespace,
/// and production's optional ServiceMonitor scrapes the Service's metrics port.
#[test]
fn kustomize_base_and_overlays_render_complete_deployments() {
    let base = by_kind(kustomize("k8s"));
    assert_eq!(
        base.keys().collect::<Vec<_>>(),
        manifests().keys().collect::<Vec<_>>(),
        "the base lists every manifest in deploy/k8s"
    );
    for (overlay, namespace, replicas, monitor) in [
        ("production", "mailroom", 3, true),
        ("staging", "mailroom-staging", 2, false),
    ] {
        let m = by_kind(kustomize(&format!("overlays/{overlay}")));
        for (kind, o) in &m {
            assert_eq!(
                o["metadata"]["namespace"].as_str(),
                Some(namespace),
                "{overlay}: {kind}"
            );
        }
        hang_together(&m);
        memory_covers_budgets(&m);
        network_policy_guards(&m);
        let d = &m["Deployment"];
        assert_eq!(d["spec"]["replicas"].as_u64(), Some(replicas), "{overlay}");
        let image = s(&d["spec"]["template"]["spec"]["containers"][0]["image"]);
        assert!(
            !image.ends_with(":latest") && image.contains(':'),
            "{overlay}: a pinned tag, not {image}"
        );
        assert!(
            d["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["grpc"]["port"]
                .as_u64()
                .is_some(),
            "{overlay}: a native gRPC startup probe"
        );

        let jobs = kustomize(&format!("overlays/{overlay}/migrate"));
        assert_eq!(jobs.len(), 1, "{overlay}/migrate renders the Job alone");
        let job = &jobs[0];
        assert_eq!(s(&job["kind"]), "Job");
        assert_eq!(s(&job["metadata"]["namespace"]), namespace);
        assert_eq!(
            s(&job["spec"]["template"]["spec"]["containers"][0]["image"]),
            image,
            "{overlay}: the Job migrates for the release it precedes"
        );

        assert_eq!(m.contains_key("ServiceMonitor"), monitor, "{overlay}");
        if let Some(sm) = m.get("ServiceMonitor") {
            let svc = &m["Service"];
            for (k, v) in sm["spec"]["selector"]["matchLabels"].as_mapping().unwrap() {
                assert_eq!(&svc["metadata"]["labels"][k], v, "selects the Service");
            }
            let port = s(&sm["spec"]["endpoints"][0]["port"]);
            let metrics = svc["spec"]["ports"]
                .as_sequence()
                .unwrap()
                .iter()
                .find(|p| s(&p["name"]) == port)
                .unwrap_or_else(|| panic!("the Service has no port {port}"));
            let listen = s(&m["ConfigMap"]["data"]["MAILROOM_METRICS_LISTEN"]);
            assert_eq!(metrics["port"].as_u64(), Some(u64::from(port_of(listen))));
            assert_eq!(s(&sm["spec"]["endpoints"][0]["path"]), "/metrics");
        }
    }
}
