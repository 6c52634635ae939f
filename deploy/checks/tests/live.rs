//! The deployment's config and commands, run for real on loopback: a
//! nats-server with the dev overlay's nats.conf (the roles' users and
//! permissions of nats-auth.conf, the Secret's passwords), the dev
//! overlay's init container and the
//! four roles exactly as the manifests start them (their args, the
//! ConfigMap's asyncrl.toml with paths and addresses moved to a temp dir and
//! free loopback ports), then
//! - `promtool check metrics` on every role's `/metrics`,
//! - every sample a role exposes is one the source parser of the static
//!   tests knows (so those tests see every metric),
//! - a real Prometheus server scrapes the four roles, evaluates the alert
//!   rules without errors, answers every dashboard query, and reads
//!   `asyncrl_policy_version` back through its HTTP API.
//!
//! Needs the `asyncrl` binary of this workspace (built by `cargo test
//! --workspace`, or `cargo build --bin asyncrl`), promtool and prometheus.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use asyncrl_config::Config;
use asyncrl_deploy_checks::{
    Rendered, http_get, k8s_dir, registered_metrics, repo_root, require_tool, sample_names,
    url_encode,
};
use asyncrl_testkit::{NatsServer, ServerConfig, free_port};
use serde_json::Value;

const ROLES: &[(&str, &str)] = &[
    ("coordinator", "coordinator"),
    ("buffer", "buffer"),
    ("learner", "learner"),
    ("rollout-worker", "worker"),
];

/// Children killed (SIGTERM, then SIGKILL) when the test ends, pass or fail.
struct Procs(Vec<(String, Child, PathBuf)>);

impl Procs {
    fn spawn(&mut self, name: &str, cmd: &mut Command, log: PathBuf) {
        let file = std::fs::File::create(&log).unwrap();
        let child = cmd
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        self.0.push((name.to_owned(), child, log));
    }

    /// Panics with the logs if a child has exited.
    fn assert_running(&mut self) {
        for (name, child, log) in &mut self.0 {
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "{name} exited ({status}):\n{}",
                    std::fs::read_to_string(log).unwrap_or_default()
                );
            }
        }
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        for (_, child, _) in &mut self.0 {
            // SAFETY-free: kill(2) through the `kill` command keeps this crate
            // free of libc; SIGTERM lets the roles drain.
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        for (_, child, _) in &mut self.0 {
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The workspace's `asyncrl` binary, next to this test's target directory.
fn asyncrl_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/live-<hash>
    let profile_dir = exe.parent().and_then(Path::parent).unwrap();
    let bin = profile_dir.join("asyncrl");
    assert!(
        bin.is_file(),
        "{} is missing: build it first (cargo build --bin asyncrl; cargo test --workspace does)",
        bin.display()
    );
    let built = bin.metadata().unwrap().modified().unwrap();
    let main = repo_root()
        .join("src/main.rs")
        .metadata()
        .unwrap()
        .modified()
        .unwrap();
    assert!(
        built >= main,
        "{} is older than src/main.rs: rebuild it (cargo build --bin asyncrl)",
        bin.display()
    );
    bin
}

fn wait_for<T>(
    what: &str,
    timeout: Duration,
    procs: &mut Procs,
    mut f: impl FnMut() -> Option<T>,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        procs.assert_running();
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The bytes of a Secret's base64 `data` value (`base64 -d`).
fn base64_decode(text: &str) -> Vec<u8> {
    use std::io::Write;
    let mut child = Command::new("base64")
        .arg("-d")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("base64 (coreutils)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "base64 -d failed");
    out.stdout
}

/// `GET /api/v1/query?query=...` on Prometheus; the `data` of a success.
fn prom_query(addr: &str, query: &str) -> Result<Value, String> {
    let (status, body) = http_get(addr, &format!("/api/v1/query?query={}", url_encode(query)))
        .map_err(|e| e.to_string())?;
    let v: Value = serde_json::from_str(&body).map_err(|e| format!("{status}: {e}: {body}"))?;
    if v["status"] != "success" {
        return Err(format!("{query}: {body}"));
    }
    Ok(v["data"].clone())
}

/// Sample names of a Prometheus text exposition.
fn exposed_samples(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

#[test]
fn prometheus_scrapes_a_local_multi_process_run_of_the_dev_overlay() {
    let asyncrl = asyncrl_binary();
    let promtool = require_tool(
        "promtool",
        "install Debian's prometheus package (scripts/setup does)",
    );
    let prometheus = require_tool(
        "prometheus",
        "install Debian's prometheus package (scripts/setup does)",
    );
    let dev = Rendered::of(&k8s_dir().join("overlays/dev"));
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();

    // The Secret's keys, as the pods mount them (each pod only its own).
    let secrets = root.join("secrets");
    std::fs::create_dir_all(&secrets).unwrap();
    let secret = dev.get("Secret", "asyncrl-secrets");
    let keys = secret["stringData"].as_object().expect("the dev Secret");
    for (key, value) in keys {
        std::fs::write(secrets.join(key), value.as_str().unwrap()).unwrap();
    }
    // The throwaway TLS Secret of the overlay: the server's certificate,
    // key and CA where the NATS pod mounts them, the CA where the roles do.
    let tls_dir = root.join("nats-tls");
    let ca_dir = root.join("tls");
    std::fs::create_dir_all(&tls_dir).unwrap();
    std::fs::create_dir_all(&ca_dir).unwrap();
    let tls_secret = dev.get("Secret", "asyncrl-nats-tls");
    for (key, value) in tls_secret["data"].as_object().expect("the dev TLS Secret") {
        let bytes = base64_decode(value.as_str().unwrap());
        std::fs::write(tls_dir.join(key), &bytes).unwrap();
        if key == "ca.crt" {
            std::fs::write(ca_dir.join(key), &bytes).unwrap();
        }
    }
    // The NATS server of the overlay: its nats.conf and nats-auth.conf, its
    // environment from the Secret (nats.yaml), TLS from the files above,
    // the monitoring port moved and the store left to the test server's
    // own directory.
    let sts = dev.get("StatefulSet", "nats");
    let nats_conf = dev.config_map_data("nats-config", "nats.conf");
    assert!(nats_conf.contains("store_dir: /data"), "{nats_conf}");
    assert!(nats_conf.contains("/etc/nats-tls/"), "{nats_conf}");
    let mut server = ServerConfig::new(
        nats_conf
            .replace(
                "0.0.0.0:8222",
                &format!("127.0.0.1:{}", free_port().unwrap()),
            )
            .replace("store_dir: /data", "")
            .replace("/etc/nats-tls", &tls_dir.display().to_string()),
    )
    .file(
        "nats-auth.conf",
        dev.config_map_data("nats-config", "nats-auth.conf"),
    );
    for env in sts["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .unwrap()
    {
        let name = env["name"].as_str().unwrap();
        let value = match env["valueFrom"]["secretKeyRef"]["key"].as_str() {
            Some(key) => keys[key].as_str().unwrap().to_owned(),
            None => "nats-0".to_owned(),
        };
        server = server.env(name, value);
    }
    let nats = NatsServer::start_with_config(&server).unwrap();

    // The ConfigMap's config, moved from the pod's paths to the temp dir and
    // from 0.0.0.0 to free loopback ports, one file per role.
    let data = root.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let config_text = dev
        .config_map_data("asyncrl-config", "asyncrl.toml")
        .replace("/var/lib/asyncrl", &data.display().to_string())
        .replace("/etc/asyncrl/secrets", &secrets.display().to_string())
        .replace("/etc/asyncrl/tls", &ca_dir.display().to_string());
    let config = Config::parse(&config_text, Some(Path::new("asyncrl.toml")))
        .unwrap_or_else(|e| panic!("the ConfigMap's config: {e}"));
    // Over TLS only: the roles refuse a plaintext server, the server
    // refuses plaintext clients.
    assert!(
        config.bus.tls.as_ref().is_some_and(|t| t.required),
        "the dev config does not require TLS"
    );
    let mut procs = Procs(Vec::new());

    // The coordinator's init container writes the data set.
    let coordinator = dev.get("Deployment", "coordinator");
    let init = &coordinator["spec"]["template"]["spec"]["initContainers"][0];
    assert_eq!(init["command"], serde_json::json!(["/bin/sh", "-c"]));
    let script = init["args"][0]
        .as_str()
        .unwrap()
        .replace("/var/lib/asyncrl", &data.display().to_string());
    let bin_dir = asyncrl.parent().unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new("/bin/sh")
        .args(["-c", &script])
        .env("PATH", &path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "init container `{script}`: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let mut ports = BTreeMap::new();
    for (role, _) in ROLES {
        let port = free_port().unwrap();
        ports.insert(*role, port);
        let mut role_config = config.clone();
        role_config.telemetry.listen = format!("127.0.0.1:{port}");
        role_config.coordinator.admin_listen = format!("127.0.0.1:{}", free_port().unwrap());
        let file = root.join(format!("{role}.toml"));
        role_config
            .write(&file)
            .unwrap_or_else(|e| panic!("{role}: {e}"));
        // The container's args, with the config path of this test.
        let kind = if *role == "buffer" {
            "StatefulSet"
        } else {
            "Deployment"
        };
        let w = dev.get(kind, role);
        let args: Vec<String> = w["spec"]["template"]["spec"]["containers"][0]["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| {
                let a = a.as_str().unwrap();
                if a == "/etc/asyncrl/asyncrl.toml" {
                    file.display().to_string()
                } else {
                    a.to_owned()
                }
            })
            .collect();
        procs.spawn(
            role,
            Command::new(&asyncrl)
                .args(&args)
                .args(["--bus", &nats.url()])
                .current_dir(&data),
            root.join(format!("{role}.log")),
        );
    }

    // Every role serves /healthz and promtool-clean /metrics.
    let (registered, unknown) = registered_metrics(&repo_root());
    assert!(unknown.is_empty(), "{unknown:?}");
    let known = sample_names(&registered);
    let mut scraped_samples = BTreeSet::new();
    for (role, port) in &ports {
        let addr = format!("127.0.0.1:{port}");
        wait_for(
            &format!("{role} /healthz"),
            Duration::from_secs(120),
            &mut procs,
            || matches!(http_get(&addr, "/healthz"), Ok((200, _))).then_some(()),
        );
        // The telemetry server starts before the role registers its
        // metrics: wait for one of the role's own.
        let anchor = match *role {
            "coordinator" => "asyncrl_policy_version",
            "buffer" => "asyncrl_buffer_ready_groups",
            "learner" => "asyncrl_learner_step",
            _ => "asyncrl_worker_policy_version",
        };
        let metrics = wait_for(
            &format!("{anchor} on {role}'s /metrics"),
            Duration::from_secs(120),
            &mut procs,
            || match http_get(&addr, "/metrics") {
                Ok((200, body)) if exposed_samples(&body).contains(anchor) => Some(body),
                _ => None,
            },
        );
        let mut check = Command::new(&promtool)
            .args(["check", "metrics"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        check
            .stdin
            .take()
            .unwrap()
            .write_all(metrics.as_bytes())
            .unwrap();
        let out = check.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "promtool check metrics on {role}'s /metrics: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let samples = exposed_samples(&metrics);
        let strangers: Vec<&String> = samples
            .iter()
            .filter(|s| s.starts_with("asyncrl_") && !known.contains_key(*s))
            .collect();
        assert!(
            strangers.is_empty(),
            "{role} exposes samples the source parser does not know (the static alert/dashboard checks would miss them): {strangers:?}"
        );
        scraped_samples.extend(samples);
    }
    assert!(scraped_samples.contains("asyncrl_policy_version"));
    assert!(scraped_samples.contains("asyncrl_rollout_workers_recommended"));

    // A real Prometheus scrapes them, with the labels the PodMonitors give,
    // and evaluates the alert rules.
    let rule = std::fs::read_to_string(k8s_dir().join("components/monitoring/prometheusrule.yaml"))
        .unwrap();
    let rule: Value = serde_yaml::from_str(&rule).unwrap();
    let rules_path = root.join("asyncrl-rules.yaml");
    std::fs::write(&rules_path, serde_yaml::to_string(&rule["spec"]).unwrap()).unwrap();
    let scrape_configs: Vec<Value> = ports
        .iter()
        .map(|(role, port)| {
            serde_json::json!({
                "job_name": format!("asyncrl/asyncrl-{role}"),
                "scrape_interval": "1s",
                "scrape_timeout": "1s",
                "static_configs": [{
                    "targets": [format!("127.0.0.1:{port}")],
                    "labels": {"namespace": "asyncrl", "role": role, "pod": format!("{role}-0")},
                }],
            })
        })
        .collect();
    let prom_config = serde_json::json!({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [rules_path.display().to_string()],
        "scrape_configs": scrape_configs,
    });
    let prom_config_path = root.join("prometheus.yml");
    std::fs::write(
        &prom_config_path,
        serde_yaml::to_string(&prom_config).unwrap(),
    )
    .unwrap();
    let prom_addr = format!("127.0.0.1:{}", free_port().unwrap());
    procs.spawn(
        "prometheus",
        Command::new(&prometheus)
            .arg(format!("--config.file={}", prom_config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                root.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address={prom_addr}")),
        root.join("prometheus.log"),
    );
    wait_for(
        "Prometheus ready",
        Duration::from_secs(30),
        &mut procs,
        || matches!(http_get(&prom_addr, "/-/ready"), Ok((200, _))).then_some(()),
    );

    // asyncrl_policy_version, read back through the query API.
    let version = wait_for(
        "asyncrl_policy_version in Prometheus",
        Duration::from_secs(30),
        &mut procs,
        || {
            let data = prom_query(
                &prom_addr,
                r#"asyncrl_policy_version{namespace="asyncrl",role="coordinator"}"#,
            )
            .ok()?;
            let v = data["result"].as_array()?.first()?["value"][1]
                .as_str()?
                .parse::<f64>()
                .ok()?;
            Some(v)
        },
    );
    assert!(version >= 0.0, "policy version {version}");
    // Every target scraped and up.
    wait_for(
        "every role up in Prometheus",
        Duration::from_secs(60),
        &mut procs,
        || {
            let up = prom_query(&prom_addr, r#"sum(up{namespace="asyncrl"})"#).ok()?;
            let up = up["result"][0]["value"][1].as_str()?.parse::<f64>().ok()?;
            (up == ROLES.len() as f64).then_some(())
        },
    );

    // Every dashboard query runs (Grafana's variables substituted).
    let dash: Value = serde_json::from_str(
        &std::fs::read_to_string(k8s_dir().join("components/monitoring/dashboards/asyncrl.json"))
            .unwrap(),
    )
    .unwrap();
    let mut queries = 0;
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().cloned().unwrap_or_default() {
            let expr = t["expr"]
                .as_str()
                .unwrap()
                .replace("$__rate_interval", "5s")
                .replace("$__range", "1m")
                .replace("$namespace", "asyncrl");
            prom_query(&prom_addr, &expr).unwrap_or_else(|e| panic!("panel {}: {e}", p["title"]));
            queries += 1;
        }
    }
    assert!(queries > 20);

    // The alert rules are loaded and evaluate without errors.
    let rules = wait_for(
        "alert rules evaluated",
        Duration::from_secs(60),
        &mut procs,
        || {
            let (_, body) = http_get(&prom_addr, "/api/v1/rules").ok()?;
            let v: Value = serde_json::from_str(&body).ok()?;
            let rules: Vec<Value> = v["data"]["groups"]
                .as_array()?
                .iter()
                .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
                .collect();
            (!rules.is_empty()
                && rules.iter().all(|r| {
                    r["lastEvaluation"]
                        .as_str()
                        .is_some_and(|t| !t.starts_with("0001"))
                }))
            .then_some(rules)
        },
    );
    for r in &rules {
        assert_eq!(r["health"], "ok", "rule {}: {}", r["name"], r["lastError"]);
    }
    procs.assert_running();

    // The users and permissions of nats-auth.conf cover what each role did:
    // the server refused nothing (a worker that starts before the
    // coordinator may only be refused creating the control bucket).
    for (role, _, log) in &procs.0 {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        for line in text.lines().filter(|l| l.contains("NATS refused")) {
            assert!(
                role == "rollout-worker"
                    && line.contains("`$JS.API.STREAM.CREATE.KV_asyncrl_control`"),
                "{role} was refused what it needs: {line}"
            );
        }
    }
    eprintln!(
        "live run: policy version {version} in Prometheus; {} samples scraped; {queries} dashboard queries; {} rules ok",
        scraped_samples.len(),
        rules.len()
    );
}
