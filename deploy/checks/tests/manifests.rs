//! The Kubernetes manifests: every overlay renders with `kubectl kustomize`,
//! passes `kubernetes-validate` (offline schemas), and has what an operator
//! relies on. The objects kubernetes-validate has no schema for (KEDA's
//! ScaledObject, the Prometheus operator's PodMonitor and PrometheusRule,
//! JobSet, Kueue's LocalQueue) are checked here field by field; a JobSet's
//! pod templates are validated as the `batch/v1` Jobs it creates.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use asyncrl_config::{Config, EngineKind, TrainerEngineName, WeightTransportName};
use asyncrl_deploy_checks::{
    Rendered, containers, k8s_dir, nats_conf_value, overlays, quantity_bytes as bytes,
    require_tool, run_ok, selects,
};
use serde_json::Value;

/// The kinds that come from CRDs; kubernetes-validate cannot know them.
const CRD_KINDS: &[&str] = &[
    "ScaledObject",
    "PodMonitor",
    "ServiceMonitor",
    "PrometheusRule",
    "JobSet",
    "LocalQueue",
];

/// The asyncrl roles and the workload that runs each (in overlays/gpu-torch
/// the learner is the replicatedJob `learner` of a JobSet instead).
const ROLES: &[(&str, &str)] = &[
    ("coordinator", "Deployment"),
    ("buffer", "StatefulSet"),
    ("learner", "Deployment"),
    ("rollout-worker", "Deployment"),
];

fn rendered() -> Vec<Rendered> {
    let all: Vec<Rendered> = overlays().iter().map(|o| Rendered::of(o)).collect();
    let names: Vec<&str> = all.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(
        names,
        ["dev", "gpu", "gpu-hpa", "gpu-torch", "gpu-vllm"],
        "the overlays"
    );
    all
}

fn name(o: &Value) -> &str {
    o["metadata"]["name"].as_str().unwrap_or_default()
}

/// The workload of a role: its Deployment or StatefulSet, or else the Job
/// of the JobSet replicatedJob of the role's name (the learner gang).
fn role_workload<'a>(r: &'a Rendered, role: &str) -> &'a Value {
    let kind = ROLES
        .iter()
        .find(|(n, _)| *n == role)
        .map(|(_, k)| *k)
        .expect("a role");
    r.find(kind, role)
        .or_else(|| r.job(role))
        .unwrap_or_else(|| {
            panic!(
                "overlay {}: no {kind} named {role}, and no JobSet replicatedJob named {role}",
                r.name
            )
        })
}

/// The config every role of an overlay reads.
fn config(r: &Rendered) -> Config {
    let text = r.config_map_data("asyncrl-config", "asyncrl.toml");
    Config::parse(&text, Some(Path::new("asyncrl.toml")))
        .unwrap_or_else(|e| panic!("overlay {}: asyncrl.toml: {e}", r.name))
}

#[test]
fn overlays_render_and_pass_kubernetes_validate() {
    let validate = require_tool(
        "kubernetes-validate",
        "run scripts/setup (kubernetes-validate is pinned in scripts/requirements.txt)",
    );
    let dir = tempfile::tempdir().unwrap();
    for r in rendered() {
        assert!(!r.objects.is_empty(), "overlay {} renders nothing", r.name);
        let file = dir.path().join(format!("{}.yaml", r.name));
        std::fs::write(&file, &r.yaml).unwrap();
        // The oldest Kubernetes we support and the newest schemas shipped.
        for version in ["1.30.0", "1.37.0"] {
            let out = run_ok(
                Command::new(&validate)
                    .args(["--strict", "-k", version])
                    .arg(&file),
            );
            for o in &r.objects {
                let kind = o["kind"].as_str().unwrap_or_default();
                if CRD_KINDS.contains(&kind) {
                    continue;
                }
                let line = format!("passed for resource {}/{}", kind.to_lowercase(), name(o));
                assert!(
                    out.contains(&line),
                    "overlay {} (k8s {version}): {kind}/{} was not validated:\n{out}",
                    r.name,
                    name(o)
                );
            }
        }
        // The pod templates of every JobSet, as the batch/v1 Jobs it creates.
        let jobsets = r.of_kind("JobSet").count();
        assert_eq!(
            r.jobs.is_empty(),
            jobsets == 0,
            "overlay {}: a JobSet without replicatedJobs",
            r.name
        );
        if !r.jobs.is_empty() {
            let file = dir.path().join(format!("{}-jobset-jobs.yaml", r.name));
            let yaml: Vec<String> = r
                .jobs
                .iter()
                .map(|j| serde_yaml::to_string(j).unwrap())
                .collect();
            std::fs::write(&file, yaml.join("---\n")).unwrap();
            for version in ["1.30.0", "1.37.0"] {
                let out = run_ok(
                    Command::new(&validate)
                        .args(["--strict", "-k", version])
                        .arg(&file),
                );
                for j in &r.jobs {
                    let line = format!("passed for resource job/{}", name(j));
                    assert!(
                        out.contains(&line),
                        "overlay {} (k8s {version}): the JobSet's Job {} was not validated:\n{out}",
                        r.name,
                        name(j)
                    );
                }
            }
        }
        for o in &r.objects {
            let kind = o["kind"].as_str().unwrap_or_default();
            assert!(
                o["kind"] == "Namespace" || o["metadata"]["namespace"] == "asyncrl",
                "overlay {}: {kind}/{} is not in namespace asyncrl",
                r.name,
                name(o)
            );
        }
    }
}

#[test]
fn every_role_runs_the_binary_with_probes_config_and_resources() {
    for r in rendered() {
        let cfg = config(&r);
        let telemetry_port: u16 = cfg
            .telemetry
            .listen_addr()
            .unwrap()
            .expect("telemetry.listen is set")
            .port();
        assert!(
            cfg.telemetry.listen.starts_with("0.0.0.0:"),
            "overlay {}: telemetry.listen must accept Prometheus and the kubelet from outside the pod",
            r.name
        );
        for (role, _) in ROLES {
            let w = role_workload(&r, role);
            let ctx = format!("overlay {} {role}", r.name);
            let pod = &w["spec"]["template"]["spec"];
            if w["kind"] == "Job" {
                // The Job controller generates a Job's selector.
                assert!(
                    w["spec"]["selector"].is_null() && w["spec"]["manualSelector"] != true,
                    "{ctx}: a Job with a hand-made selector"
                );
            } else {
                assert!(
                    selects(
                        &w["spec"]["selector"],
                        &w["spec"]["template"]["metadata"]["labels"]
                    ),
                    "{ctx}: selector does not select its own pods"
                );
            }
            let c = &pod["containers"][0];
            let image = c["image"].as_str().unwrap_or_default();
            let wants_torch = matches!(*role, "learner" | "rollout-worker");
            // The torch trainer engine runs Python with torch, transformers
            // and trainer/: the asyncrl-torch image (Dockerfile target gpu-torch).
            let torch_engine =
                *role == "learner" && cfg.learner.trainer == TrainerEngineName::Torch;
            let image_name = image.rsplit('/').next().unwrap_or_default();
            assert!(
                if torch_engine {
                    image_name.starts_with("asyncrl-torch:")
                } else if wants_torch {
                    image_name.starts_with("asyncrl:")
                } else {
                    image_name.starts_with("asyncrl-cpu:")
                },
                "{ctx}: image {image} (libtorch only where a role needs it, Python only for the torch engine)"
            );
            let role_arg = if *role == "rollout-worker" {
                "worker"
            } else {
                role
            };
            let args: Vec<&str> = c["args"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            assert_eq!(
                args,
                [role_arg, "--config", "/etc/asyncrl/asyncrl.toml"],
                "{ctx}: command line"
            );
            // The config file is the ConfigMap's asyncrl.toml.
            let mounts = c["volumeMounts"].as_array().expect("volume mounts");
            let config_mount = mounts
                .iter()
                .find(|m| m["mountPath"] == "/etc/asyncrl/asyncrl.toml")
                .unwrap_or_else(|| panic!("{ctx}: no mount of /etc/asyncrl/asyncrl.toml"));
            assert_eq!(config_mount["subPath"], "asyncrl.toml", "{ctx}");
            let volume = |n: &Value| {
                pod["volumes"]
                    .as_array()
                    .and_then(|v| v.iter().find(|v| v["name"] == *n))
                    .cloned()
                    .unwrap_or_else(|| panic!("{ctx}: no volume {n}"))
            };
            let cm = volume(&config_mount["name"]);
            let cm_name = cm["configMap"]["name"].as_str().unwrap_or_default();
            assert!(
                cm_name.starts_with("asyncrl-config"),
                "{ctx}: config volume {cm}"
            );
            // The generated name, with its content hash: a reference
            // kustomize did not rewrite names no ConfigMap.
            assert!(
                r.find("ConfigMap", cm_name).is_some(),
                "{ctx}: the config volume names ConfigMap {cm_name}, which the overlay does not render"
            );
            let secrets = mounts
                .iter()
                .find(|m| m["mountPath"] == "/etc/asyncrl/secrets")
                .unwrap_or_else(|| panic!("{ctx}: no secrets mount"));
            assert_eq!(
                volume(&secrets["name"])["secret"]["secretName"],
                "asyncrl-secrets",
                "{ctx}"
            );
            // Probes on the telemetry port.
            let port = c["ports"]
                .as_array()
                .and_then(|p| p.iter().find(|p| p["name"] == "metrics"))
                .unwrap_or_else(|| panic!("{ctx}: no port named metrics"));
            assert_eq!(port["containerPort"], telemetry_port, "{ctx}: metrics port");
            for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
                assert_eq!(c[probe]["httpGet"]["path"], path, "{ctx}: {probe}");
                assert_eq!(c[probe]["httpGet"]["port"], "metrics", "{ctx}: {probe}");
            }
            // Requests on every container; a memory limit on every container.
            for c in containers(w) {
                let res = &c["resources"];
                assert!(
                    res["requests"]["cpu"].is_string() && res["requests"]["memory"].is_string(),
                    "{ctx}: container {} has no cpu/memory requests",
                    c["name"]
                );
                assert!(
                    res["limits"]["memory"].is_string(),
                    "{ctx}: container {} has no memory limit",
                    c["name"]
                );
                assert_eq!(
                    c["securityContext"]["readOnlyRootFilesystem"], true,
                    "{ctx}"
                );
            }
            assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{ctx}");
        }
        // The coordinator's admin API behind its Service.
        let admin = cfg.coordinator.admin_addr().unwrap().expect("admin API on");
        assert_eq!(admin.ip().to_string(), "0.0.0.0", "overlay {}", r.name);
        let svc = r.get("Service", "coordinator");
        assert!(
            svc["spec"]["ports"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["port"] == admin.port() && p["targetPort"] == "admin"),
            "overlay {}: Service coordinator does not expose the admin port {}",
            r.name,
            admin.port()
        );
        assert!(
            cfg.coordinator.admin_token_file.is_some(),
            "overlay {}: the admin API needs a token (from the Secret)",
            r.name
        );
    }
}

#[test]
fn singletons_stay_single_and_the_rollout_pool_is_left_to_its_autoscaler() {
    for r in rendered() {
        for role in ["coordinator", "learner"] {
            let deployment = r.find("Deployment", role);
            let gang = r.of_kind("JobSet").find_map(|js| {
                js["spec"]["replicatedJobs"]
                    .as_array()?
                    .iter()
                    .find(|rj| rj["name"] == role)
            });
            match (deployment, gang) {
                (Some(d), None) => {
                    assert_eq!(d["spec"]["replicas"], 1, "overlay {} {role}", r.name);
                    assert_eq!(
                        d["spec"]["strategy"]["type"], "Recreate",
                        "overlay {} {role}: two at once would fight over state",
                        r.name
                    );
                }
                // The learner as node 0 of a JobSet: one Job of one pod.
                (None, Some(rj)) if role == "learner" => {
                    let job = &rj["template"]["spec"];
                    for (field, v) in [
                        (&rj["replicas"], "replicas"),
                        (&job["parallelism"], "parallelism"),
                        (&job["completions"], "completions"),
                    ] {
                        assert_eq!(
                            *field, 1,
                            "overlay {} {role}: {v}; two at once would fight over state",
                            r.name
                        );
                    }
                }
                (d, g) => panic!(
                    "overlay {} {role}: Deployment {} and JobSet replicatedJob {}: exactly one runs it",
                    r.name,
                    d.is_some(),
                    g.is_some()
                ),
            }
        }
        assert_eq!(r.get("StatefulSet", "buffer")["spec"]["replicas"], 1);
        let pool = r.get("Deployment", "rollout-worker");
        assert!(
            pool["spec"].get("replicas").is_none(),
            "overlay {}: rollout-worker sets replicas; re-applying would undo the autoscaler",
            r.name
        );
        // Only the rollout pool is autoscaled.
        for so in r.of_kind("ScaledObject") {
            assert_eq!(so["spec"]["scaleTargetRef"]["name"], "rollout-worker");
        }
        for hpa in r.of_kind("HorizontalPodAutoscaler") {
            assert_eq!(hpa["spec"]["scaleTargetRef"]["name"], "rollout-worker");
        }
    }
}

#[test]
fn grace_periods_cover_the_workers_drain() {
    for r in rendered() {
        let cfg = config(&r);
        let drain = cfg.worker.drain_grace_period.as_secs();
        let pool = r.get("Deployment", "rollout-worker");
        let grace = pool["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            .as_u64()
            .expect("terminationGracePeriodSeconds on the rollout pool");
        assert!(
            grace >= drain + 10,
            "overlay {}: terminationGracePeriodSeconds {grace} leaves no margin over worker.drain_grace_period {drain}s",
            r.name
        );
        for (role, _) in ROLES {
            let w = role_workload(&r, role);
            assert!(
                w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"].is_u64(),
                "overlay {} {role}: set terminationGracePeriodSeconds",
                r.name
            );
        }
    }
}

#[test]
fn gpus_where_the_shape_wants_them() {
    for r in rendered() {
        // Over every container of the pod: in gpu-vllm the rollout pod's
        // GPU is the vLLM sidecar's, not the worker's.
        let gpus = |role: &str| {
            containers(role_workload(&r, role))
                .into_iter()
                .filter_map(|c| c["resources"]["limits"]["nvidia.com/gpu"].as_u64())
                .reduce(|a, b| a + b)
        };
        let gpu_node = |role: &str| {
            let pod = &role_workload(&r, role)["spec"]["template"]["spec"];
            pod["nodeSelector"]["nvidia.com/gpu.present"] == "true"
                && pod["tolerations"]
                    .as_array()
                    .is_some_and(|t| t.iter().any(|t| t["key"] == "nvidia.com/gpu"))
        };
        for role in ["coordinator", "buffer"] {
            assert_eq!(gpus(role), None, "overlay {} {role}", r.name);
        }
        if r.name == "dev" {
            assert_eq!(gpus("learner"), None, "dev runs on the CPU");
            assert!(!gpu_node("learner"));
            assert_eq!(gpus("rollout-worker"), None);
        } else {
            let cfg = config(&r);
            // The torch engine runs one rank per GPU, world_size / nodes on
            // each node: the learner's pod is node 0.
            let learner_gpus = match cfg.learner.trainer {
                TrainerEngineName::Torch => {
                    (cfg.learner.torch.world_size / cfg.learner.torch.nodes) as u64
                }
                TrainerEngineName::Builtin => 1,
            };
            for (role, want) in [("learner", learner_gpus), ("rollout-worker", 1)] {
                assert_eq!(gpus(role), Some(want), "overlay {} {role}", r.name);
                assert!(
                    gpu_node(role),
                    "overlay {} {role}: GPU node selector and toleration",
                    r.name
                );
            }
            assert!(cfg.model.path.is_some(), "overlay {}: a real model", r.name);
        }
    }
}

#[test]
fn volumes_hold_what_the_config_writes() {
    for r in rendered() {
        let cfg = config(&r);
        let ctx = &r.name;
        // Each stateful role mounts a persistent volume at the directory
        // its config writes to.
        let data_dir = |role: &str| -> String {
            match role {
                "buffer" => cfg
                    .buffer
                    .data_dir_in(&cfg.run.output_dir)
                    .display()
                    .to_string(),
                "learner" => cfg
                    .learner
                    .checkpoint_dir
                    .clone()
                    .unwrap_or_else(|| cfg.run.output_dir.join("checkpoints"))
                    .display()
                    .to_string(),
                _ => cfg.run.output_dir.display().to_string(),
            }
        };
        for role in ["coordinator", "buffer", "learner"] {
            let w = role_workload(&r, role);
            let pod = &w["spec"]["template"]["spec"];
            let dir = data_dir(role);
            let mount = pod["containers"][0]["volumeMounts"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|m| dir.starts_with(m["mountPath"].as_str().unwrap_or("\0")))
                .max_by_key(|m| m["mountPath"].as_str().unwrap_or_default().len())
                .unwrap_or_else(|| panic!("overlay {ctx} {role}: nothing mounted at {dir}"))
                .clone();
            let vol_name = mount["name"].as_str().unwrap();
            let persistent = pod["volumes"]
                .as_array()
                .and_then(|v| v.iter().find(|v| v["name"] == vol_name))
                .is_some_and(|v| v["persistentVolumeClaim"]["claimName"].is_string())
                || w["spec"]["volumeClaimTemplates"]
                    .as_array()
                    .is_some_and(|t| t.iter().any(|t| t["metadata"]["name"] == vol_name));
            assert!(
                persistent,
                "overlay {ctx} {role}: {dir} is not on a persistent volume"
            );
            if let Some(claim) = pod["volumes"]
                .as_array()
                .and_then(|v| v.iter().find(|v| v["name"] == vol_name))
                .and_then(|v| v["persistentVolumeClaim"]["claimName"].as_str())
            {
                r.get("PersistentVolumeClaim", claim);
            }
        }
        // The coordinator's data set is on its volume, written by its init container.
        let coord = r.get("Deployment", "coordinator");
        let init = &coord["spec"]["template"]["spec"]["initContainers"][0];
        let script = init["args"][0].as_str().unwrap_or_default();
        for d in &cfg.coordinator.datasets {
            assert!(
                script.contains(&d.path.display().to_string()),
                "overlay {ctx}: the init container does not write {}",
                d.path.display()
            );
        }
        // The model folder is mounted where [model] path points.
        if let Some(path) = &cfg.model.path {
            for role in ["learner", "rollout-worker"] {
                let mounts = role_workload(&r, role)["spec"]["template"]["spec"]["containers"]
                    [0]["volumeMounts"]
                    .as_array()
                    .unwrap()
                    .clone();
                assert!(
                    mounts.iter().any(|m| path
                        .display()
                        .to_string()
                        .starts_with(m["mountPath"].as_str().unwrap_or("\0"))
                        && m["mountPath"] != "/"),
                    "overlay {ctx} {role}: model.path {} is not mounted",
                    path.display()
                );
            }
        }
    }
}

#[test]
fn nats_is_jetstream_with_payload_monitoring_auth_and_enough_disk() {
    for r in rendered() {
        let ctx = &r.name;
        let cfg = config(&r);
        let conf = r.config_map_data("nats-config", "nats.conf");
        assert!(
            conf.contains("jetstream"),
            "overlay {ctx}: JetStream is off"
        );
        let max_payload = bytes(
            &nats_conf_value(&conf, "max_payload")
                .unwrap_or_else(|| panic!("overlay {ctx}: nats.conf sets no max_payload")),
        );
        assert!(
            cfg.buffer.inline_reply_max_bytes < max_payload,
            "overlay {ctx}: buffer.inline_reply_max_bytes {} does not fit NATS max_payload {max_payload}",
            cfg.buffer.inline_reply_max_bytes
        );
        let http = nats_conf_value(&conf, "http").expect("nats.conf: monitoring port (http)");
        assert!(
            http.ends_with(":8222"),
            "overlay {ctx}: monitoring on {http}"
        );
        // The roles' users: the one permission file, next to nats.conf.
        assert!(
            conf.lines().any(|l| l.trim() == "include nats-auth.conf"),
            "overlay {ctx}: nats.conf does not include the permission file"
        );
        let auth = r.config_map_data("nats-config", "nats-auth.conf");
        let shipped = std::fs::read_to_string(k8s_dir().join("base/nats-auth.conf")).unwrap();
        assert_eq!(
            auth, shipped,
            "overlay {ctx}: nats-auth.conf differs from deploy/k8s/base/nats-auth.conf"
        );
        for (role, _) in NATS_USERS {
            let user = format!("ASYNCRL_{}", role.to_uppercase());
            assert!(
                conf.lines().any(|l| l.trim() == format!("${user}")),
                "overlay {ctx}: nats.conf does not list the user {user}"
            );
        }
        assert!(
            !conf.contains("token:"),
            "overlay {ctx}: a shared token next to the roles' users"
        );
        let sts = r.get("StatefulSet", "nats");
        let replicas = sts["spec"]["replicas"].as_u64().unwrap() as usize;
        assert_eq!(
            cfg.bus.replicas, replicas,
            "overlay {ctx}: bus.replicas (stream replicas) must equal the NATS servers"
        );
        if replicas > 1 {
            // A clustered JetStream flushes to disk on a fixed interval,
            // the one tests/jetstream_cluster.rs runs its cluster with
            // (docs/deploy.md, "NATS storage").
            let js = nats_conf_block(&conf, "jetstream")
                .unwrap_or_else(|| panic!("overlay {ctx}: nats.conf has no jetstream block"));
            assert_eq!(
                nats_conf_value(&js, "sync_interval").as_deref(),
                Some(asyncrl_testkit::CLUSTER_SYNC_INTERVAL),
                "overlay {ctx}: jetstream.sync_interval"
            );
            let routes = nats_routes(&r);
            for i in 0..replicas {
                assert!(
                    routes
                        .iter()
                        .any(|u| u.ends_with(&format!("@nats-{i}.nats-headless:6222"))),
                    "overlay {ctx}: no route to nats-{i}: {routes:?}"
                );
            }
        }
        let store = bytes(&nats_conf_value(&conf, "max_file_store").expect("max_file_store"));
        let disk = bytes(
            sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
                .as_str()
                .unwrap(),
        );
        assert!(
            store < disk,
            "overlay {ctx}: max_file_store {store} exceeds the volume {disk}"
        );
        let ports: Vec<Value> = containers(sts)
            .into_iter()
            .flat_map(|c| c["ports"].as_array().cloned().unwrap_or_default())
            .collect();
        for p in ["client", "monitor", "metrics"] {
            assert!(
                ports.iter().any(|x| x["name"] == p),
                "overlay {ctx}: nats port {p}"
            );
        }
        let url = &cfg.bus.url;
        assert!(
            url.starts_with("tls://nats:4222"),
            "overlay {ctx}: bus.url {url} is not the nats Service over TLS"
        );
        r.get("Service", "nats");
    }
}

#[test]
fn secrets_ship_only_in_dev() {
    for r in rendered() {
        let secret = r.find("Secret", "asyncrl-secrets");
        if r.name == "dev" {
            let s = secret.expect("dev carries its throwaway Secret");
            let mut keys = vec!["admin-token".to_owned()];
            keys.extend(
                NATS_USERS
                    .iter()
                    .map(|(role, _)| format!("nats-{role}-password")),
            );
            for key in &keys {
                assert!(
                    s["stringData"][key.as_str()].is_string(),
                    "dev Secret key {key}"
                );
            }
            // The throwaway TLS material, marked as such.
            let tls = r.get("Secret", "asyncrl-nats-tls");
            assert_eq!(tls["type"], "kubernetes.io/tls");
            assert_eq!(
                tls["metadata"]["labels"]["asyncrl.dev/throwaway"], "true",
                "dev: the TLS Secret says it is throwaway"
            );
            for key in ["tls.crt", "tls.key", "ca.crt"] {
                assert!(tls["data"][key].is_string(), "dev TLS Secret key {key}");
            }
        } else {
            assert!(
                secret.is_none(),
                "overlay {}: ships placeholder tokens; the real Secret is created by hand",
                r.name
            );
            // Nor a TLS key (asyncrl-nats-tls), nor any other Secret.
            let shipped: Vec<&str> = r.of_kind("Secret").map(name).collect();
            assert!(
                shipped.is_empty(),
                "overlay {}: ships Secrets {shipped:?}; the real ones are created by hand",
                r.name
            );
        }
    }
}

/// The NATS user of each role (deploy/k8s/base/nats-auth.conf) and the
/// workload that runs it.
const NATS_USERS: &[(&str, &str)] = &[
    ("coordinator", "coordinator"),
    ("buffer", "buffer"),
    ("learner", "learner"),
    ("worker", "rollout-worker"),
];

#[test]
fn each_role_connects_as_its_own_nats_user_and_mounts_only_its_own_password() {
    for r in rendered() {
        let cfg = config(&r);
        let ctx = &r.name;
        // No shared credentials for the role processes to fall back on.
        assert!(
            cfg.bus.user.is_none()
                && cfg.bus.token.is_none()
                && cfg.bus.token_file.is_none()
                && cfg.bus.credentials_file.is_none(),
            "overlay {ctx}: [bus] sets credentials every role would share"
        );
        let secrets_dir = "/etc/asyncrl/secrets";
        for (role, workload) in NATS_USERS {
            let auth = cfg
                .bus
                .roles
                .get(*role)
                .unwrap_or_else(|| panic!("overlay {ctx}: no [bus.roles.{role}]"));
            assert_eq!(
                auth.user.as_deref(),
                Some(*role),
                "overlay {ctx}: [bus.roles.{role}] user"
            );
            let key = format!("nats-{role}-password");
            assert_eq!(
                auth.password_file.as_deref(),
                Some(Path::new(&format!("{secrets_dir}/{key}"))),
                "overlay {ctx}: [bus.roles.{role}] password_file"
            );
            // The pod mounts the Secret's keys it needs, by name: its own
            // password (and the coordinator the admin token), no other.
            let w = role_workload(&r, workload);
            let pod = &w["spec"]["template"]["spec"];
            let mut mounted: Vec<String> = Vec::new();
            for v in pod["volumes"].as_array().unwrap() {
                if v["secret"]["secretName"] == "asyncrl-secrets" {
                    let items = v["secret"]["items"].as_array().unwrap_or_else(|| {
                        panic!("overlay {ctx} {workload}: mounts every key of the Secret")
                    });
                    for item in items {
                        assert_eq!(item["key"], item["path"], "overlay {ctx} {workload}");
                        mounted.push(item["key"].as_str().unwrap().to_owned());
                    }
                }
            }
            let mut expected = vec![key];
            if *role == "coordinator" {
                expected.insert(0, "admin-token".to_owned());
            }
            assert_eq!(
                mounted, expected,
                "overlay {ctx} {workload}: the Secret's keys in the pod"
            );
        }
        // The server reads every role's password from the Secret.
        let sts = r.get("StatefulSet", "nats");
        let env = sts["spec"]["template"]["spec"]["containers"][0]["env"]
            .as_array()
            .expect("nats env");
        let conf = r.config_map_data("nats-config", "nats-auth.conf");
        for (role, _) in NATS_USERS {
            let var = format!("NATS_{}_PASSWORD", role.to_uppercase());
            let e = env
                .iter()
                .find(|e| e["name"] == var.as_str())
                .unwrap_or_else(|| panic!("overlay {ctx}: nats has no env {var}"));
            assert_eq!(
                e["valueFrom"]["secretKeyRef"]["name"], "asyncrl-secrets",
                "overlay {ctx} {var}"
            );
            assert_eq!(
                e["valueFrom"]["secretKeyRef"]["key"],
                format!("nats-{role}-password"),
                "overlay {ctx} {var}"
            );
            assert!(
                conf.contains(&format!("password: ${var}")),
                "overlay {ctx}: nats-auth.conf does not take {var}"
            );
        }
    }
}

#[test]
fn disruption_budgets_cover_the_pool_and_nats() {
    for r in rendered() {
        for (pdb, target) in [
            ("rollout-worker", ("Deployment", "rollout-worker")),
            ("nats", ("StatefulSet", "nats")),
        ] {
            let p = r.get("PodDisruptionBudget", pdb);
            let w = r.get(target.0, target.1);
            assert!(
                selects(
                    &p["spec"]["selector"],
                    &w["spec"]["template"]["metadata"]["labels"]
                ),
                "overlay {}: PDB {pdb} does not select its pods",
                r.name
            );
        }
    }
}

/// Every pod that serves metrics is scraped by exactly one monitor endpoint
/// on a port it has.
#[test]
fn pod_monitors_scrape_every_role_once() {
    for r in rendered() {
        let monitors: Vec<&Value> = r
            .of_kind("PodMonitor")
            .chain(r.of_kind("ServiceMonitor"))
            .collect();
        if r.name == "dev" {
            assert!(monitors.is_empty(), "dev needs no Prometheus operator");
            continue;
        }
        let mut scraped: BTreeMap<String, usize> = BTreeMap::new();
        for m in &monitors {
            assert_eq!(m["apiVersion"], "monitoring.coreos.com/v1");
            assert_eq!(m["kind"], "PodMonitor", "this deployment uses PodMonitors");
            let endpoints = m["spec"]["podMetricsEndpoints"]
                .as_array()
                .unwrap_or_else(|| panic!("PodMonitor {} has no podMetricsEndpoints", name(m)));
            let selected: Vec<&Value> = r
                .workloads()
                .filter(|w| {
                    selects(
                        &m["spec"]["selector"],
                        &w["spec"]["template"]["metadata"]["labels"],
                    )
                })
                .collect();
            assert!(
                !selected.is_empty(),
                "PodMonitor {} selects nothing",
                name(m)
            );
            for w in selected {
                for e in endpoints {
                    let port = e["port"].as_str().expect("endpoint port by name");
                    assert!(
                        containers(w).iter().any(|c| c["ports"]
                            .as_array()
                            .is_some_and(|p| p.iter().any(|p| p["name"] == port))),
                        "PodMonitor {}: {} has no port {port}",
                        name(m),
                        name(w)
                    );
                    assert_eq!(e["path"], "/metrics");
                    assert!(
                        e["relabelings"]
                            .as_array()
                            .is_some_and(|rl| rl.iter().any(|x| x["targetLabel"] == "role")),
                        "PodMonitor {}: series need the `role` label the alerts use",
                        name(m)
                    );
                    *scraped.entry(name(w).to_owned()).or_default() += 1;
                }
            }
        }
        for (role, _) in ROLES {
            assert_eq!(
                scraped.get(*role),
                Some(&1),
                "overlay {}: {role} must be scraped exactly once ({scraped:?})",
                r.name
            );
        }
        assert_eq!(
            scraped.get("nats"),
            Some(&1),
            "overlay {}: the NATS exporter",
            r.name
        );
    }
}

#[test]
fn the_rollout_pool_scales_on_the_recommendation() {
    let mut scalers = 0;
    for r in rendered() {
        let cfg = config(&r);
        let namespace = "asyncrl";
        for so in r.of_kind("ScaledObject") {
            scalers += 1;
            assert_eq!(so["apiVersion"], "keda.sh/v1alpha1");
            let spec = &so["spec"];
            assert_eq!(spec["scaleTargetRef"]["name"], "rollout-worker");
            assert_eq!(spec["scaleTargetRef"]["kind"], "Deployment");
            let min = spec["minReplicaCount"].as_u64().expect("minReplicaCount");
            let max = spec["maxReplicaCount"].as_u64().expect("maxReplicaCount");
            assert!(1 <= min && min <= max, "replicas {min}..{max}");
            assert!(
                u64::from(cfg.coordinator.max_recommended_workers) <= max,
                "coordinator.max_recommended_workers {} above maxReplicaCount {max}: the pool could never reach the recommendation",
                cfg.coordinator.max_recommended_workers
            );
            let triggers = spec["triggers"].as_array().expect("triggers");
            assert_eq!(triggers.len(), 1);
            let t = &triggers[0];
            assert_eq!(t["type"], "prometheus");
            // replicas = ceil(value / threshold): threshold 1 follows the
            // recommendation one to one.
            assert_eq!(t["metricType"], "AverageValue");
            assert_eq!(t["metadata"]["threshold"], "1");
            let server = t["metadata"]["serverAddress"]
                .as_str()
                .expect("serverAddress");
            assert!(server.starts_with("http"), "serverAddress {server}");
            let query = t["metadata"]["query"].as_str().expect("query");
            let sel = asyncrl_deploy_checks::promql::selectors(query).unwrap();
            assert_eq!(sel.len(), 1, "{query}");
            assert_eq!(sel[0].metric, "asyncrl_rollout_workers_recommended");
            assert!(
                sel[0]
                    .matchers
                    .iter()
                    .any(|m| m.label == "namespace" && m.op == "=" && m.value == namespace),
                "the query must select this run's namespace: {query}"
            );
            let fallback = spec["fallback"]["replicas"]
                .as_u64()
                .expect("fallback replicas");
            assert!(min <= fallback && fallback <= max);
        }
        for hpa in r.of_kind("HorizontalPodAutoscaler") {
            scalers += 1;
            let spec = &hpa["spec"];
            assert_eq!(spec["scaleTargetRef"]["name"], "rollout-worker");
            let max = spec["maxReplicas"].as_u64().unwrap();
            assert!(spec["minReplicas"].as_u64().unwrap() >= 1);
            assert!(u64::from(cfg.coordinator.max_recommended_workers) <= max);
            let metrics = spec["metrics"].as_array().unwrap();
            assert_eq!(metrics.len(), 1);
            assert_eq!(metrics[0]["type"], "External");
            assert_eq!(
                metrics[0]["external"]["metric"]["name"],
                "asyncrl_rollout_workers_recommended"
            );
            assert_eq!(metrics[0]["external"]["target"]["type"], "AverageValue");
            assert_eq!(metrics[0]["external"]["target"]["averageValue"], "1");
            // prometheus-adapter serves that external metric, per namespace.
            let values = std::fs::read_to_string(
                k8s_dir().join("components/hpa/prometheus-adapter-values.yaml"),
            )
            .unwrap();
            let values: Value = serde_yaml::from_str(&values).unwrap();
            let rules = values["rules"]["external"]
                .as_array()
                .expect("rules.external");
            let rule = rules
                .iter()
                .find(|x| x["name"]["as"] == "asyncrl_rollout_workers_recommended")
                .expect("an external rule for asyncrl_rollout_workers_recommended");
            let series = rule["seriesQuery"].as_str().unwrap();
            assert_eq!(
                asyncrl_deploy_checks::promql::selectors(series).unwrap()[0].metric,
                "asyncrl_rollout_workers_recommended"
            );
            assert_eq!(
                rule["resources"]["overrides"]["namespace"]["resource"], "namespace",
                "the adapter must answer per namespace"
            );
            assert!(
                rule["metricsQuery"]
                    .as_str()
                    .unwrap()
                    .contains("<<.LabelMatchers>>")
            );
        }
        if ["gpu", "gpu-torch", "gpu-vllm"].contains(&r.name.as_str()) {
            assert_eq!(r.of_kind("ScaledObject").count(), 1);
            assert_eq!(r.of_kind("HorizontalPodAutoscaler").count(), 0);
        }
        if r.name == "gpu-hpa" {
            assert_eq!(r.of_kind("ScaledObject").count(), 0);
            assert_eq!(r.of_kind("HorizontalPodAutoscaler").count(), 1);
        }
    }
    assert_eq!(scalers, 4);
}

#[test]
fn the_dashboard_ships_for_the_grafana_sidecar() {
    for r in rendered() {
        if r.name == "dev" {
            continue;
        }
        let cm = r.get("ConfigMap", "asyncrl-dashboard");
        assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
        let json: Value = serde_json::from_str(cm["data"]["asyncrl.json"].as_str().unwrap())
            .expect("dashboard JSON");
        assert_eq!(json["uid"], "asyncrl-run");
        let rule = r.get("PrometheusRule", "asyncrl");
        assert!(
            rule["spec"]["groups"]
                .as_array()
                .is_some_and(|g| !g.is_empty())
        );
    }
}

/// The value of `--name value` or `--name=value` in a command line.
fn flag_value<'a>(args: &[&'a str], name: &str) -> Option<&'a str> {
    args.iter().copied().enumerate().find_map(|(i, a)| {
        if a == name {
            args.get(i + 1).copied()
        } else {
            a.strip_prefix(name).and_then(|rest| rest.strip_prefix('='))
        }
    })
}

/// Where container `c` mounts the volume `volume`.
fn mount_path<'a>(c: &'a Value, volume: &str) -> Option<&'a str> {
    c["volumeMounts"]
        .as_array()?
        .iter()
        .find(|m| m["name"] == volume)?["mountPath"]
        .as_str()
}

/// overlays/gpu-vllm: each rollout pod is the worker plus a vLLM server.
/// vLLM's dev-mode routes (pause, reload_weights, resume, generate) have no
/// authentication, so it listens on the pod's loopback only; the worker
/// writes each version's weights where vLLM reloads them, so both mount the
/// shared emptyDir at the path of `worker.engine.weights_dir`; the pod's GPU
/// is vLLM's; KEDA scales the pool as it scales the built-in workers.
#[test]
fn gpu_vllm_pairs_each_worker_with_a_loopback_vllm() {
    let r = Rendered::of(&k8s_dir().join("overlays/gpu-vllm"));
    let cfg = config(&r);
    let pool = r.get("Deployment", "rollout-worker");
    let pod = &pool["spec"]["template"]["spec"];
    let all = containers(pool);
    let names: Vec<&str> = all.iter().filter_map(|c| c["name"].as_str()).collect();
    assert_eq!(
        names,
        ["vllm", "worker"],
        "gpu-vllm: the rollout pod's containers (init containers first)"
    );
    let (vllm, worker) = (all[0], all[1]);
    assert_eq!(
        vllm["restartPolicy"], "Always",
        "gpu-vllm: vllm is a native sidecar, so it keeps serving while the worker drains"
    );

    // The engine the worker drives, on loopback only.
    assert_eq!(
        cfg.worker.engine.kind,
        EngineKind::Vllm,
        "gpu-vllm: worker.engine.kind"
    );
    let args: Vec<&str> = vllm["args"]
        .as_array()
        .expect("gpu-vllm: vllm args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(
        flag_value(&args, "--host"),
        Some("127.0.0.1"),
        "gpu-vllm: the unauthenticated dev-mode routes must stay on the pod's loopback: {args:?}"
    );
    assert_eq!(
        flag_value(&args, "--logprobs-mode"),
        Some("processed_logprobs"),
        "gpu-vllm: the worker refuses raw log-probs: {args:?}"
    );
    assert!(
        args.contains(&"--enable-scale-out"),
        "gpu-vllm: /inference/v1/generate needs --enable-scale-out: {args:?}"
    );
    assert!(
        vllm["env"].as_array().is_some_and(|e| e
            .iter()
            .any(|e| e["name"] == "VLLM_SERVER_DEV_MODE" && e["value"] == "1")),
        "gpu-vllm: the RL routes need VLLM_SERVER_DEV_MODE=1"
    );
    let port = flag_value(&args, "--port").unwrap_or("8000");
    assert_eq!(
        cfg.worker.engine.endpoints,
        [format!("http://127.0.0.1:{port}")],
        "gpu-vllm: worker.engine.endpoints is the sidecar"
    );
    assert!(
        cfg.worker.engine.launch.is_empty(),
        "gpu-vllm: the kubelet runs vLLM; the worker attaches"
    );
    // vLLM serves the model the learner trains and the worker tokenizes with.
    assert_eq!(
        flag_value(&args, "--model").map(Path::new),
        cfg.model.path.as_deref(),
        "gpu-vllm: vLLM's --model and [model] path"
    );
    let max_model_len: usize = flag_value(&args, "--max-model-len")
        .expect("gpu-vllm: --max-model-len")
        .parse()
        .expect("a number");
    assert!(
        max_model_len >= cfg.model.max_seq_len,
        "gpu-vllm: --max-model-len {max_model_len} below model.max_seq_len {}",
        cfg.model.max_seq_len
    );

    // The per-version weight folders: one emptyDir, the same path in both
    // containers, and that path is worker.engine.weights_dir.
    let weights = pod["volumes"]
        .as_array()
        .and_then(|v| v.iter().find(|v| v["name"] == "engine-weights"))
        .expect("gpu-vllm: volume engine-weights");
    assert!(
        weights["emptyDir"].is_object(),
        "gpu-vllm: engine-weights is an emptyDir: {weights}"
    );
    let at_worker = mount_path(worker, "engine-weights").expect("worker mounts engine-weights");
    let at_vllm = mount_path(vllm, "engine-weights").expect("vllm mounts engine-weights");
    assert_eq!(
        at_worker, at_vllm,
        "gpu-vllm: vLLM reloads the path the worker writes"
    );
    assert_eq!(
        cfg.worker.engine.weights_dir.as_path(),
        Path::new(at_worker),
        "gpu-vllm: worker.engine.weights_dir is the shared mount"
    );

    // The GPU is vLLM's; the worker needs none.
    assert_eq!(
        vllm["resources"]["limits"]["nvidia.com/gpu"].as_u64(),
        Some(1),
        "gpu-vllm: vllm's GPU limit"
    );
    for part in ["limits", "requests"] {
        assert!(
            worker["resources"][part].get("nvidia.com/gpu").is_none(),
            "gpu-vllm: nvidia.com/gpu in the worker's {part}; the pod's GPU is vLLM's"
        );
    }

    // KEDA scales these pods exactly as it scales the built-in workers.
    let scaled: Vec<&Value> = r.of_kind("ScaledObject").collect();
    assert_eq!(scaled.len(), 1, "gpu-vllm: one ScaledObject");
    assert_eq!(scaled[0]["spec"]["scaleTargetRef"]["kind"], "Deployment");
    assert_eq!(
        scaled[0]["spec"]["scaleTargetRef"]["name"],
        "rollout-worker"
    );
    let gpu = Rendered::of(&k8s_dir().join("overlays/gpu"));
    assert_eq!(
        scaled[0]["spec"],
        gpu.get("ScaledObject", "rollout-worker")["spec"],
        "gpu-vllm: the same scaling as overlays/gpu"
    );
}

/// Parameters of the model overlays/gpu-torch trains, Qwen2.5-7B: 7.62 B
/// (docs/deploy.md 2d rounds it to 7.6 B). The volume and memory sizes of
/// the gang follow from it.
const GPU_TORCH_MODEL_PARAMS: u64 = 7_620_000_000;

/// The mount of container `c` that holds `path` (the longest mountPath that
/// is `path` or one of its parents).
fn mount_holding<'a>(c: &'a Value, path: &Path) -> Option<&'a Value> {
    c["volumeMounts"]
        .as_array()?
        .iter()
        .filter(|m| {
            m["mountPath"]
                .as_str()
                .is_some_and(|p| p != "/" && path.starts_with(p))
        })
        .max_by_key(|m| m["mountPath"].as_str().unwrap_or_default().len())
}

/// The volume named `name` of a pod spec.
fn pod_volume<'a>(pod: &'a Value, name: &Value) -> Option<&'a Value> {
    pod["volumes"]
        .as_array()?
        .iter()
        .find(|v| v["name"] == *name)
}

/// The ReadWriteMany claim mounted at `path` in the first container of a
/// workload, panicking with `what` when the path is on anything else.
fn rwx_claim_at<'a>(r: &'a Rendered, w: &Value, path: &Path, what: &str) -> &'a Value {
    let ctx = format!("overlay {} {}", r.name, w["metadata"]["name"]);
    let c = &w["spec"]["template"]["spec"]["containers"][0];
    let mount = mount_holding(c, path)
        .unwrap_or_else(|| panic!("{ctx}: nothing mounted at {} ({what})", path.display()));
    assert_eq!(
        mount["mountPath"].as_str().map(Path::new),
        Some(path),
        "{ctx}: {what} must be the mount itself, at the same path in every pod"
    );
    let volume = pod_volume(&w["spec"]["template"]["spec"], &mount["name"])
        .unwrap_or_else(|| panic!("{ctx}: no volume {}", mount["name"]));
    let claim = volume["persistentVolumeClaim"]["claimName"]
        .as_str()
        .unwrap_or_else(|| panic!("{ctx}: {what} is not on a PersistentVolumeClaim: {volume}"));
    let pvc = r.get("PersistentVolumeClaim", claim);
    assert!(
        pvc["spec"]["accessModes"]
            .as_array()
            .is_some_and(|m| m.iter().any(|m| m == "ReadWriteMany")),
        "{ctx}: {what}: claim {claim} is not ReadWriteMany, but pods on several nodes mount it"
    );
    pvc
}

/// overlays/gpu-torch: the learner's torch engine as one FSDP2 group over
/// `learner.torch.nodes` pods of a JobSet, admitted all at once by Kueue,
/// restarted all at once, node 0 reachable at the rendezvous address, every
/// rank with its GPUs, shared memory and the volumes it reads and writes.
#[test]
fn gpu_torch_runs_the_learner_as_one_gang_admitted_by_kueue() {
    let r = Rendered::of(&k8s_dir().join("overlays/gpu-torch"));
    let cfg = config(&r);
    let t = &cfg.learner.torch;
    assert_eq!(
        cfg.learner.trainer,
        TrainerEngineName::Torch,
        "gpu-torch: learner.trainer"
    );
    assert!(t.nodes > 1, "gpu-torch: a gang of more than one node");
    assert!(
        r.find("Deployment", "learner").is_none(),
        "gpu-torch: no learner Deployment beside the gang"
    );

    // One JobSet: node 0 (`learner`) and the other nodes (`trainer`).
    let jobsets: Vec<&Value> = r.of_kind("JobSet").collect();
    assert_eq!(jobsets.len(), 1, "gpu-torch: one JobSet");
    let js = jobsets[0];
    assert_eq!(js["apiVersion"], "jobset.x-k8s.io/v1alpha2");
    let spec = &js["spec"];
    let rjobs = spec["replicatedJobs"].as_array().expect("replicatedJobs");
    let rnames: Vec<&str> = rjobs.iter().filter_map(|j| j["name"].as_str()).collect();
    assert_eq!(
        rnames,
        ["learner", "trainer"],
        "gpu-torch: the replicatedJobs"
    );
    let (lead, followers) = (&rjobs[0], &rjobs[1]);

    // Kueue admits the whole set: the queue label names a LocalQueue of the
    // overlay. No `suspend`: Kueue's webhook creates the set suspended, and
    // one in the manifest would suspend an admitted gang at every apply.
    let queue = js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]
        .as_str()
        .expect("gpu-torch: the JobSet's kueue.x-k8s.io/queue-name label");
    let lq = r.get("LocalQueue", queue);
    assert_eq!(lq["apiVersion"], "kueue.x-k8s.io/v1beta2");
    assert!(
        spec.get("suspend").is_none(),
        "gpu-torch: spec.suspend is Kueue's to set; re-applying would undo its admission"
    );

    // A failure restarts every Job of the set, after the old pods are gone.
    let fp = &spec["failurePolicy"];
    assert!(
        fp["maxRestarts"].as_u64().is_some_and(|n| n >= 1),
        "gpu-torch: failurePolicy.maxRestarts ≥ 1: {fp}"
    );
    assert_eq!(
        fp["restartStrategy"], "BlockingRecreate",
        "gpu-torch: a new learner must not start while the old one still writes its checkpoint"
    );
    for rule in fp["rules"].as_array().into_iter().flatten() {
        let action = rule["action"].as_str().unwrap_or_default();
        assert!(
            matches!(
                action,
                "RestartJobSet" | "RestartJobSetAndIgnoreMaxRestarts" | "FailJobSet"
            ),
            "gpu-torch: failure rule {rule}: restarting one Job cannot rejoin a torch group"
        );
    }
    assert_eq!(
        spec["successPolicy"]["operator"], "All",
        "gpu-torch: successPolicy"
    );

    // Each Job fails with its first failed pod, so the gang restarts.
    for rj in rjobs {
        let job = &rj["template"]["spec"];
        let ctx = format!("gpu-torch {}", rj["name"]);
        assert_eq!(rj["replicas"], 1, "{ctx}: replicas");
        assert_eq!(job["backoffLimit"], 0, "{ctx}: backoffLimit");
        assert_eq!(
            job["template"]["spec"]["restartPolicy"], "Never",
            "{ctx}: restartPolicy"
        );
        assert_eq!(job["completionMode"], "Indexed", "{ctx}: completionMode");
    }
    let ffs = &followers["template"]["spec"];
    let others = (t.nodes - 1) as u64;
    assert_eq!(
        ffs["completions"].as_u64(),
        Some(others),
        "gpu-torch trainer: completions = nodes - 1"
    );
    assert_eq!(
        ffs["parallelism"].as_u64(),
        Some(others),
        "gpu-torch trainer: parallelism = nodes - 1"
    );

    // The commands: node 0 is the learner, the others take their node rank
    // from JOB_COMPLETION_INDEX (+1), with the same config file.
    let learner = r.job("learner").unwrap();
    let trainer = r.job("trainer").unwrap();
    let args = |w: &Value| -> Vec<String> {
        w["spec"]["template"]["spec"]["containers"][0]["args"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(
        args(learner),
        ["learner", "--config", "/etc/asyncrl/asyncrl.toml"]
    );
    assert_eq!(
        args(trainer),
        ["trainer-node", "--config", "/etc/asyncrl/asyncrl.toml"],
        "gpu-torch trainer: no --node-rank, so it is JOB_COMPLETION_INDEX + 1"
    );
    let config_map = |w: &Value| -> String {
        let pod = &w["spec"]["template"]["spec"];
        let c = &pod["containers"][0];
        let m = mount_holding(c, Path::new("/etc/asyncrl/asyncrl.toml")).expect("config mount");
        pod_volume(pod, &m["name"]).unwrap()["configMap"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    assert_eq!(
        config_map(trainer),
        config_map(learner),
        "gpu-torch: one config for the gang"
    );
    assert!(r.find("ConfigMap", &config_map(trainer)).is_some());
    // The trainer nodes do not connect to NATS: no key of the Secret.
    assert!(
        trainer["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .is_some_and(|v| v.iter().all(|v| v["secret"].is_null())),
        "gpu-torch trainer: mounts a Secret it has no use for"
    );
    let image = |w: &Value| w["spec"]["template"]["spec"]["containers"][0]["image"].clone();
    assert_eq!(
        image(trainer),
        image(learner),
        "gpu-torch: one image for the gang"
    );

    // Node 0's address: the learner pod's JobSet hostname on the JobSet's
    // headless Service, published before the pod is ready (the other nodes
    // connect while it loads the model); the port is the learner's.
    let net = &spec["network"];
    assert_eq!(
        net["enableDNSHostnames"], true,
        "gpu-torch: spec.network.enableDNSHostnames"
    );
    assert_eq!(
        net["publishNotReadyAddresses"], true,
        "gpu-torch: spec.network.publishNotReadyAddresses"
    );
    let subdomain = net["subdomain"]
        .as_str()
        .expect("gpu-torch: spec.network.subdomain, set explicitly");
    let rendezvous = t
        .rendezvous
        .as_deref()
        .expect("gpu-torch: learner.torch.rendezvous");
    let (host, port) = rendezvous.rsplit_once(':').unwrap();
    let hostname = format!(
        "{}-{}-0-0",
        js["metadata"]["name"].as_str().unwrap(),
        lead["name"].as_str().unwrap()
    );
    let names_node0 = [
        format!("{hostname}.{subdomain}"),
        format!("{hostname}.{subdomain}.asyncrl"),
        format!("{hostname}.{subdomain}.asyncrl.svc"),
        format!("{hostname}.{subdomain}.asyncrl.svc.cluster.local"),
    ];
    assert!(
        names_node0.iter().any(|n| n == host),
        "gpu-torch: learner.torch.rendezvous host {host} is not the learner pod ({hostname}.{subdomain})"
    );
    let port: u64 = port.parse().unwrap();
    assert!(
        learner["spec"]["template"]["spec"]["containers"][0]["ports"]
            .as_array()
            .is_some_and(|p| p.iter().any(|p| p["containerPort"] == port)),
        "gpu-torch learner: no containerPort {port} (learner.torch.rendezvous)"
    );

    // Every pod of the gang: one node's GPUs, shared memory, IPC_LOCK, and
    // host memory for the ranks' start (global rank 0, in the learner's
    // pod, reads the model in fp32 once; every rank needs a few GB).
    let per_node = (t.world_size / t.nodes) as u64;
    for w in [learner, trainer] {
        let ctx = format!("gpu-torch {}", w["metadata"]["name"]);
        let pod = &w["spec"]["template"]["spec"];
        let c = &pod["containers"][0];
        let res = &c["resources"];
        let gpus = res["limits"]["nvidia.com/gpu"].as_u64().unwrap_or(0);
        assert_eq!(
            gpus * t.nodes as u64,
            t.world_size as u64,
            "{ctx}: nvidia.com/gpu {gpus} × {} nodes is not learner.torch.world_size {}",
            t.nodes,
            t.world_size
        );
        assert_eq!(
            res["requests"]["nvidia.com/gpu"].as_u64(),
            Some(gpus),
            "{ctx}: GPU requests = limits"
        );
        assert!(
            pod["nodeSelector"]["nvidia.com/gpu.present"] == "true",
            "{ctx}: GPU nodes"
        );
        let shm = mount_holding(c, Path::new("/dev/shm"))
            .filter(|m| m["mountPath"] == "/dev/shm")
            .unwrap_or_else(|| panic!("{ctx}: nothing mounted at /dev/shm"));
        let shm_volume = pod_volume(pod, &shm["name"]).unwrap();
        assert_eq!(
            shm_volume["emptyDir"]["medium"], "Memory",
            "{ctx}: /dev/shm in memory"
        );
        let shm_bytes = bytes(
            shm_volume["emptyDir"]["sizeLimit"]
                .as_str()
                .unwrap_or_else(|| panic!("{ctx}: /dev/shm has no sizeLimit")),
        );
        assert!(
            shm_bytes >= 1 << 30,
            "{ctx}: /dev/shm of {shm_bytes} bytes is too small for NCCL"
        );
        let memory = bytes(res["limits"]["memory"].as_str().expect("memory limit"));
        let copy = if std::ptr::eq(w, learner) {
            4 * GPU_TORCH_MODEL_PARAMS
        } else {
            0
        };
        let start = copy + per_node * (4 << 30);
        assert!(
            memory >= start + shm_bytes,
            "{ctx}: memory limit {memory} below the model copy ({copy} bytes) + {per_node} ranks × 4 GiB + /dev/shm {shm_bytes}"
        );
        assert!(
            c["securityContext"]["capabilities"]["add"]
                .as_array()
                .is_some_and(|a| a.iter().any(|x| x == "IPC_LOCK")),
            "{ctx}: IPC_LOCK (RDMA pins memory)"
        );
        // The model every rank loads.
        let model = cfg.model.path.as_deref().expect("model.path");
        assert!(
            mount_holding(c, model).is_some(),
            "{ctx}: model.path {} is not mounted",
            model.display()
        );
    }

    // The checkpoint folder: every rank writes its DCP shards into the same
    // ReadWriteMany claim, mounted at learner.checkpoint_dir in every pod.
    let ckpt_dir = cfg
        .learner
        .checkpoint_dir
        .clone()
        .expect("learner.checkpoint_dir");
    let claims: Vec<&Value> = [learner, trainer]
        .into_iter()
        .map(|w| rwx_claim_at(&r, w, &ckpt_dir, "learner.checkpoint_dir"))
        .collect();
    assert_eq!(
        claims[0]["metadata"]["name"], claims[1]["metadata"]["name"],
        "gpu-torch: one checkpoint claim for the gang"
    );
    let per_checkpoint = 12 * GPU_TORCH_MODEL_PARAMS;
    let need = (cfg.learner.keep_checkpoints as u64 + 1) * per_checkpoint;
    let size = bytes(
        claims[0]["spec"]["resources"]["requests"]["storage"]
            .as_str()
            .unwrap(),
    );
    assert!(
        size >= need + need / 10,
        "gpu-torch: checkpoint claim {size} bytes below (keep_checkpoints {} + 1) × 12 bytes × {GPU_TORCH_MODEL_PARAMS} parameters + 10 %",
        cfg.learner.keep_checkpoints
    );

    // The weights of each version: written by the learner into
    // shared_weights_dir, read there by the other ranks and every worker.
    assert_eq!(
        cfg.learner.weight_transport,
        WeightTransportName::SharedPath
    );
    let shared = cfg
        .learner
        .shared_weights_dir
        .clone()
        .expect("learner.shared_weights_dir");
    let pool = r.get("Deployment", "rollout-worker");
    let mut claim_names = Vec::new();
    for (w, writes) in [(learner, true), (trainer, false), (pool, false)] {
        let pvc = rwx_claim_at(&r, w, &shared, "learner.shared_weights_dir");
        claim_names.push(pvc["metadata"]["name"].clone());
        let m = mount_holding(&w["spec"]["template"]["spec"]["containers"][0], &shared).unwrap();
        assert_eq!(
            m["readOnly"] == true,
            !writes,
            "gpu-torch {}: shared weights read-only except in the learner",
            w["metadata"]["name"]
        );
        if writes {
            let need = (cfg.learner.keep_weight_versions as u64 + 1) * 2 * GPU_TORCH_MODEL_PARAMS;
            let size = bytes(
                pvc["spec"]["resources"]["requests"]["storage"]
                    .as_str()
                    .unwrap(),
            );
            assert!(
                size >= need,
                "gpu-torch: shared weights claim {size} bytes below (keep_weight_versions + 1) × 2 bytes × parameters"
            );
        }
    }
    assert!(
        claim_names.windows(2).all(|w| w[0] == w[1]),
        "gpu-torch: one shared weights claim: {claim_names:?}"
    );

    // Stopping the set: the learner's checkpoint on SIGTERM needs every
    // rank, so the trainer nodes wait (preStop) for the learner's grace
    // period before their own SIGTERM.
    let grace = |w: &Value| {
        w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            .as_u64()
            .unwrap()
    };
    let wait: u64 = trainer["spec"]["template"]["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        .as_array()
        .and_then(|c| match &c[..] {
            [cmd, secs] if cmd == "sleep" => secs.as_str()?.parse().ok(),
            _ => None,
        })
        .expect("gpu-torch trainer: preStop exec [sleep, N]");
    assert!(
        wait >= grace(learner),
        "gpu-torch trainer: preStop {wait}s shorter than the learner's grace {}s",
        grace(learner)
    );
    assert!(
        grace(trainer) > wait,
        "gpu-torch trainer: terminationGracePeriodSeconds within its preStop"
    );

    // The ClusterQueue a cluster admin creates (kueue-admin.yaml) is the one
    // the LocalQueue names, takes this namespace, covers every resource the
    // gang requests and holds all of it at once.
    let admin = asyncrl_deploy_checks::yaml_docs(
        &std::fs::read_to_string(k8s_dir().join("components/torch-gang/kueue-admin.yaml")).unwrap(),
    );
    let cq = admin
        .iter()
        .find(|o| {
            o["kind"] == "ClusterQueue" && o["metadata"]["name"] == lq["spec"]["clusterQueue"]
        })
        .unwrap_or_else(|| {
            panic!(
                "gpu-torch: kueue-admin.yaml has no ClusterQueue {}",
                lq["spec"]["clusterQueue"]
            )
        });
    assert_eq!(cq["apiVersion"], "kueue.x-k8s.io/v1beta2");
    assert!(
        selects(
            &cq["spec"]["namespaceSelector"],
            &serde_json::json!({"kubernetes.io/metadata.name": "asyncrl"})
        ),
        "gpu-torch: the ClusterQueue does not take namespace asyncrl"
    );
    let mut requested: BTreeMap<String, u64> = BTreeMap::new();
    for (rj, w) in [(lead, learner), (followers, trainer)] {
        let pods = rj["replicas"].as_u64().unwrap() * w["spec"]["parallelism"].as_u64().unwrap();
        for c in containers(w) {
            for (res, q) in c["resources"]["requests"].as_object().into_iter().flatten() {
                let q = q
                    .as_str()
                    .map(str::to_owned)
                    .unwrap_or_else(|| q.to_string());
                let amount = if res == "cpu" {
                    q.parse::<u64>().expect("whole CPUs")
                } else {
                    bytes(&q)
                };
                *requested.entry(res.clone()).or_default() += pods * amount;
            }
        }
    }
    let groups = cq["spec"]["resourceGroups"]
        .as_array()
        .expect("resourceGroups");
    for (res, total) in &requested {
        let group = groups
            .iter()
            .find(|g| g["coveredResources"].as_array().is_some_and(|c| c.iter().any(|c| c == res.as_str())))
            .unwrap_or_else(|| panic!("gpu-torch: the ClusterQueue does not cover {res}; Kueue would never admit the gang"));
        let quota: u64 = group["flavors"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|f| f["resources"].as_array().cloned().unwrap_or_default())
            .filter(|q| q["name"] == res.as_str())
            .map(|q| match &q["nominalQuota"] {
                Value::Number(n) => n.as_u64().unwrap(),
                v => {
                    let s = v.as_str().unwrap();
                    if res == "cpu" {
                        s.parse().unwrap()
                    } else {
                        bytes(s)
                    }
                }
            })
            .sum();
        assert!(
            quota >= *total,
            "gpu-torch: the ClusterQueue's {res} quota {quota} is below the gang's {total}"
        );
    }
    for f in groups
        .iter()
        .flat_map(|g| g["flavors"].as_array().cloned().unwrap_or_default())
    {
        assert!(
            admin
                .iter()
                .any(|o| o["kind"] == "ResourceFlavor" && o["metadata"]["name"] == f["name"]),
            "gpu-torch: kueue-admin.yaml lacks the ResourceFlavor {}",
            f["name"]
        );
    }
}

/// The inside of block `name { ... }` (or `name: { ... }`) at the top level
/// of `conf`, a nats.conf or the inside of one of its blocks; comments cut.
fn nats_conf_block(conf: &str, name: &str) -> Option<String> {
    let mut depth = 0usize;
    let mut inside: Option<(usize, String)> = None;
    for line in conf.lines() {
        let l = line.split('#').next().unwrap_or_default().trim();
        let opens = l.matches('{').count();
        let closes = l.matches('}').count();
        if let Some((d, text)) = inside.as_mut() {
            let after = depth + opens - closes.min(depth + opens);
            if after < *d {
                return inside.map(|(_, t)| t);
            }
            text.push_str(l);
            text.push('\n');
        } else if depth == 0 {
            let head = l.strip_prefix(name).map(str::trim_start);
            let head = head.map(|h| h.strip_prefix(':').unwrap_or(h).trim_start());
            if head == Some("{") {
                inside = Some((1, String::new()));
            }
        }
        depth = depth + opens - closes.min(depth + opens);
    }
    None
}

/// The entries of the list `key: [ ... ]` at the top level of `conf`, one
/// per line or comma-separated.
fn nats_conf_list(conf: &str, key: &str) -> Vec<String> {
    let mut entries = Vec::new();
    let mut open = false;
    for line in conf.lines() {
        let l = line.split('#').next().unwrap_or_default().trim();
        let rest = if open {
            l
        } else if let Some(r) = l
            .strip_prefix(key)
            .map(|r| r.trim_start().strip_prefix(':').unwrap_or(r).trim_start())
            .and_then(|r| r.strip_prefix('['))
        {
            open = true;
            r
        } else {
            continue;
        };
        let (items, closed) = match rest.split_once(']') {
            Some((items, _)) => (items, true),
            None => (rest, false),
        };
        entries.extend(
            items
                .split([',', ' '])
                .map(|e| e.trim().trim_matches('"'))
                .filter(|e| !e.is_empty())
                .map(str::to_owned),
        );
        if closed {
            break;
        }
    }
    entries
}

/// The value of the environment variable `var` of the NATS container.
fn nats_env(r: &Rendered, var: &str) -> Option<Value> {
    r.get("StatefulSet", "nats")["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == var)
        .cloned()
}

/// A nats.conf value: literal, or `$VAR` resolved through the NATS
/// container's environment (literal values only; None for a Secret's).
fn nats_conf_resolve(r: &Rendered, v: &str) -> Option<String> {
    match v.strip_prefix('$') {
        Some(var) => nats_env(r, var)?["value"].as_str().map(str::to_owned),
        None => Some(v.to_owned()),
    }
}

/// The route URLs of the overlay's nats.conf (cluster.routes), resolved.
fn nats_routes(r: &Rendered) -> Vec<String> {
    let conf = r.config_map_data("nats-config", "nats.conf");
    let cluster = nats_conf_block(&conf, "cluster").unwrap_or_default();
    nats_conf_list(&cluster, "routes")
        .iter()
        .map(|e| {
            nats_conf_resolve(r, e)
                .unwrap_or_else(|| panic!("overlay {}: route {e} is no literal", r.name))
        })
        .collect()
}

/// The Secret and key behind the file `path` in container `c` of pod spec
/// `pod`: the Secret volume mounted above it and the item at that path.
fn secret_file(pod: &Value, c: &Value, path: &Path) -> Option<(String, String)> {
    let mount = mount_holding(c, path)?;
    let volume = pod_volume(pod, &mount["name"])?;
    let secret = volume["secret"]["secretName"].as_str()?;
    let rel = path
        .strip_prefix(mount["mountPath"].as_str()?)
        .ok()?
        .to_str()?;
    let key = match volume["secret"]["items"].as_array() {
        Some(items) => items.iter().find(|i| i["path"] == rel)?["key"]
            .as_str()?
            .to_owned(),
        None => rel.to_owned(),
    };
    Some((secret.to_owned(), key))
}

/// The Secret holding the NATS server's certificate and key and the CA.
const NATS_TLS_SECRET: &str = "asyncrl-nats-tls";

/// TLS is the only way onto the bus: every overlay's NATS serves TLS on
/// its client port with the certificate and key of the Secret
/// asyncrl-nats-tls, and every role dials tls:// with TLS required and
/// that Secret's CA, mounting the CA alone (never the key).
#[test]
fn nats_serves_tls_and_every_role_requires_it_with_the_ca() {
    for r in rendered() {
        let ctx = &r.name;
        let conf = r.config_map_data("nats-config", "nats.conf");
        let tls = nats_conf_block(&conf, "tls").unwrap_or_else(|| {
            panic!("overlay {ctx}: nats.conf has no tls block on the client port")
        });
        assert!(
            nats_conf_value(&conf, "allow_non_tls").is_none_or(|v| v == "false"),
            "overlay {ctx}: nats.conf lets plaintext clients in (allow_non_tls)"
        );
        let sts = r.get("StatefulSet", "nats");
        let pod = &sts["spec"]["template"]["spec"];
        for (field, key) in [("cert_file", "tls.crt"), ("key_file", "tls.key")] {
            let file = nats_conf_value(&tls, field)
                .unwrap_or_else(|| panic!("overlay {ctx}: nats.conf tls.{field}"));
            assert_eq!(
                secret_file(pod, &pod["containers"][0], Path::new(&file)),
                Some((NATS_TLS_SECRET.to_owned(), key.to_owned())),
                "overlay {ctx}: nats.conf tls.{field} {file} is not {key} of the Secret {NATS_TLS_SECRET}"
            );
        }

        let cfg = config(&r);
        assert!(
            cfg.bus.url.starts_with("tls://"),
            "overlay {ctx}: bus.url {} is not tls://",
            cfg.bus.url
        );
        for (role, workload) in NATS_USERS {
            let rctx = format!("overlay {ctx} {role}");
            let bus = cfg.bus.for_role(role);
            let tls = bus
                .tls
                .unwrap_or_else(|| panic!("{rctx}: no [bus.tls] for the role"));
            assert!(tls.required, "{rctx}: [bus.tls] required = false");
            let ca = tls
                .ca_file
                .unwrap_or_else(|| panic!("{rctx}: [bus.tls] has no ca_file"));
            let w = role_workload(&r, workload);
            let pod = &w["spec"]["template"]["spec"];
            let c = &pod["containers"][0];
            assert_eq!(
                secret_file(pod, c, &ca),
                Some((NATS_TLS_SECRET.to_owned(), "ca.crt".to_owned())),
                "{rctx}: ca_file {} is not ca.crt of the Secret {NATS_TLS_SECRET}",
                ca.display()
            );
            for v in pod["volumes"].as_array().unwrap() {
                if v["secret"]["secretName"] == NATS_TLS_SECRET {
                    let keys: Vec<&Value> = v["secret"]["items"]
                        .as_array()
                        .unwrap_or_else(|| panic!("{rctx}: mounts the server's key"))
                        .iter()
                        .map(|i| &i["key"])
                        .collect();
                    assert_eq!(
                        keys,
                        ["ca.crt"],
                        "{rctx}: of {NATS_TLS_SECRET}, the CA only"
                    );
                }
            }
        }
    }
}

/// The clustered NATS (3 servers) lets only its own servers route: a route
/// user whose password is the Secret's, and mutual TLS on the routes with
/// the Secret's certificate and CA.
#[test]
fn the_nats_cluster_authorizes_its_routes_over_mutual_tls() {
    let mut clustered = 0;
    for r in rendered() {
        let ctx = &r.name;
        let conf = r.config_map_data("nats-config", "nats.conf");
        let replicas = r.get("StatefulSet", "nats")["spec"]["replicas"]
            .as_u64()
            .unwrap();
        let Some(cluster) = nats_conf_block(&conf, "cluster") else {
            assert_eq!(replicas, 1, "overlay {ctx}: {replicas} servers, no cluster");
            continue;
        };
        clustered += 1;
        // Route authorization: the user and the Secret's password.
        let auth = nats_conf_block(&cluster, "authorization")
            .unwrap_or_else(|| panic!("overlay {ctx}: cluster without authorization"));
        let user = nats_conf_value(&auth, "user")
            .unwrap_or_else(|| panic!("overlay {ctx}: cluster.authorization.user"));
        let password = nats_conf_value(&auth, "password")
            .unwrap_or_else(|| panic!("overlay {ctx}: cluster.authorization.password"));
        let var = password
            .strip_prefix('$')
            .unwrap_or_else(|| panic!("overlay {ctx}: a route password in the ConfigMap"));
        let env =
            nats_env(&r, var).unwrap_or_else(|| panic!("overlay {ctx}: nats has no env {var}"));
        assert_eq!(
            env["valueFrom"]["secretKeyRef"]["name"], "asyncrl-secrets",
            "overlay {ctx}: {var}"
        );
        assert_eq!(
            env["valueFrom"]["secretKeyRef"]["key"], "nats-route-password",
            "overlay {ctx}: {var}"
        );
        // Mutual TLS on the routes, from the Secret.
        let tls = nats_conf_block(&cluster, "tls")
            .unwrap_or_else(|| panic!("overlay {ctx}: routes without TLS"));
        assert_eq!(
            nats_conf_value(&tls, "verify").as_deref(),
            Some("true"),
            "overlay {ctx}: cluster.tls must verify the peer's certificate"
        );
        let sts = r.get("StatefulSet", "nats");
        let pod = &sts["spec"]["template"]["spec"];
        for (field, key) in [
            ("cert_file", "tls.crt"),
            ("key_file", "tls.key"),
            ("ca_file", "ca.crt"),
        ] {
            let file = nats_conf_value(&tls, field)
                .unwrap_or_else(|| panic!("overlay {ctx}: cluster.tls.{field}"));
            assert_eq!(
                secret_file(pod, &pod["containers"][0], Path::new(&file)),
                Some((NATS_TLS_SECRET.to_owned(), key.to_owned())),
                "overlay {ctx}: cluster.tls.{field} {file}"
            );
        }
        // Every route dials with that user and password. Kubernetes expands
        // $(VAR) only from variables defined before, so the password first.
        let names: Vec<&str> = pod["containers"][0]["env"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|e| e["name"].as_str())
            .collect();
        let at = |n: &str| names.iter().position(|x| *x == n);
        let routes = nats_conf_list(&cluster, "routes");
        assert_eq!(routes.len() as u64, replicas, "overlay {ctx}: the routes");
        for (i, route) in routes.iter().enumerate() {
            let url = nats_conf_resolve(&r, route).unwrap();
            assert_eq!(
                url,
                format!("nats://{user}:$({var})@nats-{i}.nats-headless:6222"),
                "overlay {ctx}: route {route}"
            );
            if let Some(rv) = route.strip_prefix('$') {
                assert!(
                    at(var) < at(rv),
                    "overlay {ctx}: {rv} is defined before {var}"
                );
            }
        }
        // Peers and clients dial names on the certificate, not pod IPs.
        assert_eq!(
            nats_conf_value(&cluster, "no_advertise").as_deref(),
            Some("true"),
            "overlay {ctx}: clients would get the servers' IPs, which the certificate does not name"
        );
        let advertise = nats_conf_value(&cluster, "advertise")
            .and_then(|a| nats_conf_resolve(&r, &a))
            .unwrap_or_else(|| panic!("overlay {ctx}: cluster.advertise"));
        assert_eq!(advertise, "$(POD_NAME).nats-headless:6222", "overlay {ctx}");
    }
    assert_eq!(clustered, 4, "the gpu overlays run a NATS cluster");
}

/// A pod that might send traffic: its labels and its namespace.
struct Source {
    name: String,
    namespace: &'static str,
    labels: Value,
}

/// Whether the NetworkPolicies of `r` admit TCP traffic from `src` to
/// `port` of the pod template `target` (in namespace asyncrl), by the
/// NetworkPolicy rules: a pod no Ingress policy selects takes everything; a
/// selected pod takes what any rule of any policy selecting it allows.
fn admits(r: &Rendered, target: &Value, port: &Value, src: &Source) -> bool {
    let labels = &target["spec"]["template"]["metadata"]["labels"];
    let number = port["containerPort"].as_u64().unwrap();
    let policies: Vec<&Value> = r
        .of_kind("NetworkPolicy")
        .filter(|p| {
            let types = &p["spec"]["policyTypes"];
            (types.is_null() || types.as_array().unwrap().iter().any(|t| t == "Ingress"))
                && selects(&p["spec"]["podSelector"], labels)
        })
        .collect();
    if policies.is_empty() {
        return true;
    }
    let ns_labels = serde_json::json!({ "kubernetes.io/metadata.name": src.namespace });
    policies.iter().any(|p| {
        p["spec"]["ingress"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|rule| {
                let port_ok = match rule["ports"].as_array() {
                    None => true,
                    Some(ps) if ps.is_empty() => true,
                    Some(ps) => ps.iter().any(|p| {
                        p["protocol"].as_str().unwrap_or("TCP") == "TCP"
                            && match &p["port"] {
                                Value::Null => true,
                                Value::Number(n) => {
                                    let lo = n.as_u64().unwrap();
                                    let hi = p["endPort"].as_u64().unwrap_or(lo);
                                    (lo..=hi).contains(&number)
                                }
                                Value::String(s) => port["name"] == s.as_str(),
                                _ => false,
                            }
                    }),
                };
                let from_ok = match rule["from"].as_array() {
                    None => true,
                    Some(peers) if peers.is_empty() => true,
                    Some(peers) => peers.iter().any(|peer| {
                        if !peer["ipBlock"].is_null() {
                            return true;
                        }
                        let ns = &peer["namespaceSelector"];
                        let pods = &peer["podSelector"];
                        let ns_ok = if ns.is_null() {
                            src.namespace == "asyncrl"
                        } else {
                            selects(ns, &ns_labels)
                        };
                        ns_ok && (pods.is_null() || selects(pods, &src.labels))
                    }),
                };
                port_ok && from_ok
            })
    })
}

/// Ingress in namespace asyncrl is denied by default and admitted exactly
/// where a pod needs it: the roles to NATS' client port, NATS to NATS on the
/// route port, Prometheus (namespace monitoring) to the ports the
/// PodMonitors scrape, pods labelled asyncrl.dev/admin-client to the
/// coordinator's admin port, and in gpu-torch the gang's pods to each other.
/// Every port of every pod is checked against every pod of the overlay and
/// a few strangers; vLLM's loopback port has no containerPort and needs none.
#[test]
fn network_policies_admit_exactly_what_each_role_needs() {
    let admin_port = 7461;
    for r in rendered() {
        let ctx = &r.name;
        let policies: Vec<&Value> = r.of_kind("NetworkPolicy").collect();
        assert!(
            policies.iter().any(|p| {
                p["spec"]["podSelector"]
                    .as_object()
                    .is_some_and(|s| s.is_empty())
                    && p["spec"]["policyTypes"]
                        .as_array()
                        .is_some_and(|t| t.iter().any(|t| t == "Ingress"))
                    && p["spec"]["ingress"].as_array().is_none_or(|i| i.is_empty())
            }),
            "overlay {ctx}: no default-deny ingress NetworkPolicy (podSelector {{}}, no rules)"
        );
        for p in &policies {
            for rule in p["spec"]["ingress"].as_array().into_iter().flatten() {
                assert!(
                    rule["from"].as_array().is_some_and(|f| !f.is_empty()),
                    "overlay {ctx}: NetworkPolicy {} admits every source",
                    name(p)
                );
                for peer in rule["from"].as_array().unwrap() {
                    assert!(
                        peer["ipBlock"].is_null(),
                        "overlay {ctx}: NetworkPolicy {}: an ipBlock",
                        name(p)
                    );
                }
            }
        }
        let workloads: Vec<&Value> = r.workloads().collect();
        for w in &workloads {
            let labels = &w["spec"]["template"]["metadata"]["labels"];
            assert!(
                policies
                    .iter()
                    .any(|p| selects(&p["spec"]["podSelector"], labels)
                        && p["spec"]["policyTypes"]
                            .as_array()
                            .is_some_and(|t| t.iter().any(|t| t == "Ingress"))),
                "overlay {ctx}: no ingress NetworkPolicy selects the pods of {}",
                name(w)
            );
        }

        // Who might knock: every pod of the overlay, and strangers.
        let mut sources: Vec<Source> = workloads
            .iter()
            .map(|w| Source {
                name: name(w).to_owned(),
                namespace: "asyncrl",
                labels: w["spec"]["template"]["metadata"]["labels"].clone(),
            })
            .collect();
        let coordinator_labels =
            r.get("Deployment", "coordinator")["spec"]["template"]["metadata"]["labels"].clone();
        let admin_client = serde_json::json!({"asyncrl.dev/admin-client": "true"});
        let prometheus = serde_json::json!({"app.kubernetes.io/name": "prometheus"});
        for (n, ns, labels) in [
            ("admin-client", "asyncrl", admin_client.clone()),
            ("admin-client elsewhere", "other", admin_client),
            ("prometheus", "monitoring", prometheus.clone()),
            ("prometheus elsewhere", "other", prometheus),
            (
                "grafana",
                "monitoring",
                serde_json::json!({"app": "grafana"}),
            ),
            ("unlabelled pod", "asyncrl", serde_json::json!({})),
            ("a coordinator elsewhere", "other", coordinator_labels),
        ] {
            sources.push(Source {
                name: n.to_owned(),
                namespace: ns,
                labels,
            });
        }

        // What Prometheus scrapes: the PodMonitors' ports.
        let mut scraped: Vec<(String, String)> = Vec::new();
        for m in r.of_kind("PodMonitor") {
            for w in &workloads {
                if selects(
                    &m["spec"]["selector"],
                    &w["spec"]["template"]["metadata"]["labels"],
                ) {
                    for e in m["spec"]["podMetricsEndpoints"].as_array().unwrap() {
                        scraped.push((name(w).to_owned(), e["port"].as_str().unwrap().to_owned()));
                    }
                }
            }
        }
        let gang: Vec<&str> = if r.of_kind("JobSet").count() > 0 {
            vec!["learner", "trainer"]
        } else {
            vec![]
        };
        let roles = ["coordinator", "buffer", "learner", "rollout-worker"];

        let mut checked_admin = false;
        for w in &workloads {
            let target = name(w);
            for c in containers(w) {
                for port in c["ports"].as_array().into_iter().flatten() {
                    let number = port["containerPort"].as_u64().unwrap();
                    let pname = port["name"].as_str().unwrap_or_default();
                    let mut expected: Vec<&str> = match (target, number) {
                        ("nats", 4222) => roles.to_vec(),
                        ("nats", 6222) => vec!["nats"],
                        ("coordinator", p) if p == admin_port => {
                            checked_admin = true;
                            vec!["admin-client"]
                        }
                        _ => vec![],
                    };
                    if scraped.contains(&(target.to_owned(), pname.to_owned())) {
                        expected.push("prometheus");
                    }
                    if gang.contains(&target) {
                        expected.extend(&gang);
                    }
                    let admitted: Vec<&str> = sources
                        .iter()
                        .filter(|s| admits(&r, w, port, s))
                        .map(|s| s.name.as_str())
                        .collect();
                    let mut want: Vec<&str> = sources
                        .iter()
                        .map(|s| s.name.as_str())
                        .filter(|s| expected.contains(s))
                        .collect();
                    want.dedup();
                    assert_eq!(
                        admitted, want,
                        "overlay {ctx}: who reaches {target}:{number} ({pname})"
                    );
                }
            }
        }
        assert!(
            checked_admin,
            "overlay {ctx}: the coordinator has no admin port {admin_port}"
        );
    }
}
