//! `Config` as a value: every config written with [`Config::to_toml`] loads
//! back (validated) as an equal `Config`. Checked on every shipped config,
//! on the defaults, and on random valid configs in which every key of every
//! section takes non-default values (durations down to the nanosecond,
//! every enum variant, optional keys set and unset, secrets, data sets,
//! role tables), so a key that is written under a wrong name, left out, or
//! written in a form the loader reads differently fails here.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use asyncrl_config::{
    AdminTlsConfig, AdvantageNormName, BUS_ROLES, BatchingMode, BufferConfig, BusConfig,
    ClipModeName, Config, CoordinatorConfig, DatasetConfig, DatasetFormat, DeviceName, EngineApi,
    EngineConfig, EngineKind, EvalConfig, EvalEngineName, FsyncPolicy, ImportanceCorrectionName,
    InitialKnobs, KlEstimatorName, LearnerConfig, LogFormat, LongPrompts, LossAggregationName,
    MixedPrecisionName, ModelConfig, PauseMode, ProximalName, RetentionPolicy, RoleAuth, RunConfig,
    SamplingPolicy, Secret, SegmentCompression, StalenessConfig, StorageConfig, TelemetryConfig,
    TinyModelConfig, TlsConfig, TorchEngineConfig, TrainerEngineName, TrajectoryRetention,
    WeightDtypeName, WeightTransportName, WorkerConfig, WorkerRewardConfig,
};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestRunner};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_owned()
}

/// Serialises `config`, loads the text back through the validating loader,
/// and checks that the result is equal and serialises to the same text.
fn assert_round_trip(config: &Config) -> Result<(), String> {
    let text = config
        .to_toml()
        .map_err(|e| format!("to_toml of {config:?}: {e}"))?;
    let back = Config::parse(&text, None).map_err(|e| format!("{e}\nin:\n{text}"))?;
    if &back != config {
        return Err(format!(
            "loaded back differs\nwritten:\n{text}\nwas: {config:#?}\ngot: {back:#?}"
        ));
    }
    let again = back.to_toml().map_err(|e| e.to_string())?;
    if again != text {
        return Err(format!("second write differs:\n{text}\n---\n{again}"));
    }
    Ok(())
}

#[test]
fn every_shipped_config_round_trips() {
    let root = repo_root();
    let mut paths: Vec<PathBuf> = std::fs::read_dir(root.join("examples"))
        .expect("examples/")
        .map(|e| e.expect("an examples/ entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    paths.push(root.join("deploy/k8s/base/asyncrl.toml"));
    for e in std::fs::read_dir(root.join("deploy/k8s/components")).expect("components/") {
        let p = e.expect("a components/ entry").path().join("asyncrl.toml");
        if p.exists() {
            paths.push(p);
        }
    }
    // examples/: arith, arith-staleness, arith-vllm, gsm8k-qwen2.5, local;
    // deploy: base + gpu + vllm-sidecar.
    assert!(paths.len() >= 8, "found {} configs", paths.len());
    for path in paths {
        let config = Config::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_round_trip(&config).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
}

#[test]
fn the_default_config_is_valid_and_round_trips() {
    Config::default().validate().expect("the default config");
    assert_round_trip(&Config::default()).unwrap();
    // An empty file is the default config.
    assert_eq!(Config::parse("", None).unwrap(), Config::default());
}

#[test]
fn an_isolated_config_opens_no_port_and_round_trips() {
    let config = Config::isolated("/tmp/run x", "nats://127.0.0.1:4222");
    config.validate().expect("an isolated config");
    assert_eq!(config.run.output_dir, PathBuf::from("/tmp/run x"));
    assert_eq!(config.bus.url, "nats://127.0.0.1:4222");
    assert_eq!(config.telemetry.listen_addr().unwrap(), None);
    assert_eq!(config.coordinator.admin_addr().unwrap(), None);
    assert_round_trip(&config).unwrap();
    assert_round_trip(&Config::isolated("out", "local")).unwrap();
}

#[test]
fn write_validates_and_load_reads_it_back() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("role.toml");
    let mut config = Config::isolated(dir.path().join("run"), "nats://127.0.0.1:4222");
    config.bus.token = Some(Secret::new("tok \"quoted\"\n"));
    config.coordinator.admin_token = Some("admin-secret".into());
    config.write(&path).expect("write");
    assert_eq!(Config::load(&path).expect("load"), config);

    // An invalid config is refused before it reaches a file, naming its key.
    config.staleness.group_size = 0;
    let other = dir.path().join("bad.toml");
    let err = config.write(&other).unwrap_err().to_string();
    assert!(err.contains("staleness.group_size"), "{err}");
    assert!(!other.exists());

    // An unwritable path names the path.
    config.staleness.group_size = 2;
    let missing = dir.path().join("no/such/dir/role.toml");
    let err = config.write(&missing).unwrap_err().to_string();
    assert!(err.contains("no/such/dir/role.toml"), "{err}");
}

#[test]
fn secrets_are_written_but_not_debug_printed() {
    let mut config = Config::isolated("out", "nats://n:4222");
    config.bus.user = Some("u".into());
    config.bus.password = Some(Secret::new("pw-789"));
    let text = config.to_toml().unwrap();
    assert!(text.contains("pw-789"), "{text}");
    assert!(!format!("{config:?}").contains("pw-789"));
    assert_round_trip(&config).unwrap();
}

// ---- random valid configs -------------------------------------------------

/// A duration in [lo, hi] milliseconds: whole milliseconds, or with a
/// nanosecond part (humantime writes `1s 500ms 3ns`).
fn dur_ms(lo: u64, hi: u64) -> impl Strategy<Value = Duration> {
    prop_oneof![
        (lo..=hi).prop_map(Duration::from_millis),
        (lo..=hi, 0u32..1_000_000)
            .prop_map(|(ms, ns)| Duration::from_millis(ms) + Duration::from_nanos(u64::from(ns))),
        (lo.div_ceil(1000)..=hi / 1000).prop_map(Duration::from_secs),
    ]
}

/// Text that exercises TOML's string escapes (quotes, backslashes,
/// newlines, non-ASCII).
fn text() -> impl Strategy<Value = String> {
    prop_oneof!["[a-z][a-z0-9_-]{0,11}", "(?s).{1,16}"]
        .prop_filter("non-blank", |s: &String| !s.trim().is_empty())
}

fn path() -> impl Strategy<Value = PathBuf> {
    prop_oneof!["/[a-z0-9/ ._-]{1,20}", "[a-zA-Z0-9é ._-]{1,12}"].prop_map(PathBuf::from)
}

fn name() -> impl Strategy<Value = String> {
    "[A-Za-z0-9_-]{1,16}"
}

fn run() -> impl Strategy<Value = RunConfig> {
    (
        "[A-Za-z0-9._-]{1,20}",
        path(),
        0..=i64::MAX as u64,
        0..=i64::MAX as u64,
    )
        .prop_map(|(name, output_dir, seed, max_steps)| RunConfig {
            name,
            output_dir,
            seed,
            max_steps,
        })
}

fn staleness() -> impl Strategy<Value = StalenessConfig> {
    (0..=StalenessConfig::MAX_ETA, 1u32..=4096, 1u32..=1024).prop_map(
        |(eta, groups_per_step, group_size)| StalenessConfig {
            eta,
            groups_per_step,
            group_size,
        },
    )
}

fn tls() -> impl Strategy<Value = TlsConfig> {
    (
        any::<bool>(),
        proptest::option::of(path()),
        proptest::option::of((path(), path())),
    )
        .prop_map(|(required, ca_file, client)| TlsConfig {
            required,
            ca_file,
            cert_file: client.as_ref().map(|c| c.0.clone()),
            key_file: client.map(|c| c.1),
        })
}

/// One auth method: (user, password, password_file, token, token_file,
/// credentials_file).
type Auth = (
    Option<String>,
    Option<Secret>,
    Option<PathBuf>,
    Option<Secret>,
    Option<PathBuf>,
    Option<PathBuf>,
);

fn auth(allow_none: bool) -> impl Strategy<Value = Auth> {
    let none: Auth = (None, None, None, None, None, None);
    let methods = prop_oneof![
        (text(), text()).prop_map(|(u, p)| (Some(u), Some(Secret::new(p)), None, None, None, None)),
        (text(), path()).prop_map(|(u, f)| (Some(u), None, Some(f), None, None, None)),
        text().prop_map(|t| (None, None, None, Some(Secret::new(t)), None, None)),
        path().prop_map(|f| (None, None, None, None, Some(f), None)),
        path().prop_map(|f| (None, None, None, None, None, Some(f))),
    ];
    if allow_none {
        prop_oneof![1 => Just(none), 5 => methods].boxed()
    } else {
        methods.boxed()
    }
}

fn role_auth() -> impl Strategy<Value = RoleAuth> {
    (auth(false), proptest::option::of(tls()), inbox_prefix()).prop_map(|(a, tls, inbox)| {
        RoleAuth {
            user: a.0,
            password: a.1,
            password_file: a.2,
            token: a.3,
            token_file: a.4,
            credentials_file: a.5,
            tls,
            inbox_prefix: inbox,
        }
    })
}

fn inbox_prefix() -> impl Strategy<Value = Option<String>> {
    proptest::option::of("_INBOX(\\.[a-z0-9_-]{1,8}){1,3}")
}

fn storage() -> impl Strategy<Value = StorageConfig> {
    const MIB: u64 = 1024 * 1024;
    (
        prop_oneof![
            Just(TrajectoryRetention::Release),
            Just(TrajectoryRetention::Keep)
        ],
        MIB..=1 << 50,
        dur_ms(0, 30 * 24 * 3600 * 1000),
        MIB..=1 << 50,
        dur_ms(1, 30 * 24 * 3600 * 1000),
        MIB..=1 << 50,
        prop_oneof![Just(0), 16 * MIB..=1 << 40],
        dur_ms(100, 3600 * 1000),
    )
        .prop_map(|(t, tb, ta, db, da, kv, os, re)| StorageConfig {
            trajectories: t,
            trajectories_max_bytes: tb,
            trajectories_max_age: ta,
            dead_letters_max_bytes: db,
            dead_letters_max_age: da,
            kv_max_bytes: kv,
            object_store_max_bytes: os,
            report_every: re,
        })
}

fn bus() -> impl Strategy<Value = BusConfig> {
    let url = prop_oneof![
        Just("local".to_owned()),
        "(nats|tls|ws|wss)://[a-z0-9.]{1,12}:[0-9]{1,5}",
        "nats://[a-z]{1,8}:4222,nats://[a-z]{1,8}:4223",
    ];
    let roles = proptest::collection::btree_map(
        proptest::sample::select(BUS_ROLES.to_vec()).prop_map(str::to_owned),
        role_auth(),
        0..=4,
    );
    (
        (
            url,
            auth(true),
            proptest::option::of(tls()),
            roles,
            inbox_prefix(),
        ),
        (
            dur_ms(1, 600_000),
            dur_ms(1, 600_000),
            dur_ms(1, 600_000),
            1usize..=1 << 24,
            dur_ms(1, 3_600_000),
            1usize..=5,
            storage(),
        ),
    )
        .prop_map(
            |((url, a, tls, roles, inbox), (ct, rt, rd, cap, dw, replicas, storage))| BusConfig {
                url,
                user: a.0,
                password: a.1,
                password_file: a.2,
                token: a.3,
                token_file: a.4,
                credentials_file: a.5,
                tls,
                roles,
                inbox_prefix: inbox,
                connect_timeout: ct,
                request_timeout: rt,
                reconnect_max_delay: rd,
                subscription_capacity: cap,
                duplicate_window: dw,
                replicas,
                storage,
                // Not a setting (never in a file): its default round-trips.
                open_stores_only: false,
            },
        )
}

fn telemetry() -> impl Strategy<Value = TelemetryConfig> {
    (
        prop_oneof![
            Just(String::new()),
            "127\\.0\\.0\\.1:[0-9]{1,4}",
            Just("[::1]:9000".to_owned())
        ],
        prop_oneof![Just(LogFormat::Text), Just(LogFormat::Json)],
        text(),
    )
        .prop_map(|(listen, log_format, log_filter)| TelemetryConfig {
            listen,
            log_format,
            log_filter,
        })
}

fn model() -> impl Strategy<Value = ModelConfig> {
    let tiny = (1i64..=8, 1i64..=8, 8i64..=64, 1i64..=4, 8i64..=16384).prop_map(
        |(kv, groups, head_dim, layers, intermediate)| TinyModelConfig {
            hidden_size: kv * groups * head_dim,
            num_hidden_layers: layers,
            num_attention_heads: kv * groups,
            num_key_value_heads: kv,
            intermediate_size: intermediate,
        },
    );
    (
        (proptest::option::of(path()), tiny),
        prop_oneof![
            Just(DeviceName::Auto),
            Just(DeviceName::Cpu),
            Just(DeviceName::Cuda)
        ],
        (0.0f64..=10.0, prop_oneof![Just(1.0f64), 1e-6f64..1.0]),
        (1usize..=1 << 16, 1usize..=1 << 16),
        prop_oneof![Just(WeightDtypeName::F32), Just(WeightDtypeName::Bf16)],
        0i32..=1024,
        proptest::collection::vec(0i64..=i64::MAX, 0..4),
        proptest::collection::vec(text(), 0..3),
    )
        .prop_map(
            |(
                (path, tiny),
                device,
                (temperature, top_p),
                (new, extra),
                dtype,
                threads,
                ids,
                strings,
            )| {
                ModelConfig {
                    path,
                    tiny,
                    device,
                    temperature,
                    top_p,
                    max_new_tokens: new,
                    max_seq_len: new + extra,
                    weight_dtype: dtype,
                    cpu_threads: threads,
                    stop_token_ids: ids,
                    stop_strings: strings,
                }
            },
        )
}

fn dataset(builtin_verifier: bool) -> impl Strategy<Value = DatasetConfig> {
    let verifier = if builtin_verifier {
        proptest::sample::select(vec!["arith", "reverse", "math"])
            .prop_map(|v| Some(v.to_owned()))
            .boxed()
    } else {
        proptest::option::of(
            proptest::sample::select(vec!["arith", "reverse", "math", "service"])
                .prop_map(str::to_owned),
        )
        .boxed()
    };
    (
        (name(), path()),
        prop_oneof![
            Just(DatasetFormat::Auto),
            Just(DatasetFormat::Jsonl),
            Just(DatasetFormat::Parquet)
        ],
        ("p[a-z]{0,8}", "a[a-z]{0,8}", "[a-z]{1,8}"),
        any::<bool>(),
        proptest::option::of(text()),
        verifier,
        proptest::option::of(1usize..=1 << 20),
        prop_oneof![Just(LongPrompts::Error), Just(LongPrompts::Skip)],
    )
        .prop_map(
            |((name, path), format, (p, a, id), chat, system, verifier, max, long)| DatasetConfig {
                name,
                path,
                format,
                prompt_field: p,
                answer_field: a,
                id_field: id,
                apply_chat_template: chat,
                system_prompt: system,
                verifier,
                max_prompt_tokens: max,
                long_prompts: long,
            },
        )
}

fn knobs() -> impl Strategy<Value = InitialKnobs> {
    (
        0.0f64..=0.99,
        0.0f64..=10.0,
        proptest::sample::select(ClipModeName::ALL.to_vec()),
        0.01f64..=0.999,
        1e-4f64..=100.0,
        1.0f64..=1000.0,
        (
            proptest::sample::select(ImportanceCorrectionName::ALL.to_vec()),
            0.0f64..=1.0,
            prop_oneof![Just(0.0f64), 1.0f64..=1000.0],
        ),
        1e-9f64..=1.0,
        any::<bool>(),
    )
        .prop_map(
            |(lo, hi, clip_mode, q, t, cap, (correction, floor, dual_clip), lr, paused)| {
                InitialKnobs {
                    eps_low: lo,
                    eps_high: hi,
                    clip_mode,
                    adaptive_quantile: q,
                    adaptive_temperature: t,
                    importance_weight_cap: cap,
                    importance_correction: correction,
                    importance_weight_floor: floor,
                    dual_clip,
                    learning_rate: lr,
                    paused,
                }
            },
        )
}

fn coordinator() -> impl Strategy<Value = CoordinatorConfig> {
    let datasets = proptest::collection::vec(dataset(false), 0..4).prop_map(|mut ds| {
        // Names must be unique.
        for (i, d) in ds.iter_mut().enumerate() {
            d.name = format!("{}-{i}", d.name);
        }
        ds
    });
    let admin_tls = proptest::option::of(
        (
            proptest::option::of((path(), path())),
            proptest::option::of(path()),
            proptest::option::of(text()),
        )
            .prop_map(|(server, ca_file, domain)| AdminTlsConfig {
                cert_file: server.as_ref().map(|s| s.0.clone()),
                key_file: server.map(|s| s.1),
                ca_file,
                domain,
            }),
    );
    let admin_token = prop_oneof![
        Just((None, None)),
        text().prop_map(|t| (Some(t), None)),
        path().prop_map(|p| (None, Some(p))),
    ];
    (
        (
            datasets,
            dur_ms(1, 60_000),
            2u32..=10,
            2u32..=10,
            dur_ms(1, 60_000),
        ),
        (
            1u32..=4096,
            prop_oneof![
                Just(String::new()),
                any::<u16>().prop_map(|port| format!("127.0.0.1:{port}"))
            ],
            admin_token,
            admin_tls,
            proptest::option::of(path()),
            (0usize..=65_536, 0u32..=1_000),
            1u32..=100_000,
            knobs(),
        ),
    )
        .prop_map(
            |(
                (datasets, heartbeat, lease_x, dead_x, retry_after),
                (
                    max_tasks,
                    admin_listen,
                    (token, token_file),
                    admin_tls,
                    journal,
                    (memory, attempts),
                    workers,
                    knobs,
                ),
            )| CoordinatorConfig {
                datasets,
                lease_timeout: heartbeat * lease_x,
                heartbeat_interval: heartbeat,
                dead_after: heartbeat * dead_x,
                retry_after,
                max_tasks_per_acquire: max_tasks,
                admin_listen,
                admin_token: token,
                admin_token_file: token_file,
                admin_tls,
                journal_path: journal,
                completed_memory: memory,
                max_task_attempts: attempts,
                max_recommended_workers: workers,
                initial_knobs: knobs,
            },
        )
}

fn buffer() -> impl Strategy<Value = BufferConfig> {
    let sampling = prop_oneof![
        Just((SamplingPolicy::Fifo, None)),
        Just((SamplingPolicy::FreshFirst, None)),
        proptest::option::of(1u32..=64).prop_map(|k| (SamplingPolicy::Reuse, k)),
    ];
    (
        (
            proptest::option::of(path()),
            64 * 1024..=1u64 << 40,
            prop_oneof![
                Just(SegmentCompression::None),
                Just(SegmentCompression::Zstd)
            ],
            prop_oneof![Just(FsyncPolicy::Always), Just(FsyncPolicy::Never)],
            sampling,
            prop_oneof![Just(RetentionPolicy::Delete), Just(RetentionPolicy::Keep)],
            any::<bool>(),
            prop_oneof![Just(0.0f64), 0.0f64..=2.0],
        ),
        (
            1024u64..=64 * 1024 * 1024,
            name(),
            name(),
            1usize..=10_000,
            dur_ms(1000, 600_000),
            0usize..=100_000,
            dur_ms(0, 600_000),
            4096u64..=1 << 40,
        ),
    )
        .prop_flat_map(
            |(
                (
                    data_dir,
                    seg,
                    compression,
                    fsync,
                    (sampling, reuse_max),
                    retention,
                    zstd,
                    min_spread,
                ),
                (inline, bucket, consumer, ingest, ack_wait, extra_pending, max_wait, compact),
            )| {
                // fetch_wait in (0, ack_wait / 2].
                let half_ns = (ack_wait / 2).as_nanos() as u64;
                (1u64..=half_ns).prop_map(move |fetch_ns| BufferConfig {
                    data_dir: data_dir.clone(),
                    segment_max_bytes: seg,
                    segment_compression: compression,
                    fsync,
                    sampling,
                    reuse_max,
                    retention,
                    serve_zstd: zstd,
                    inline_reply_max_bytes: inline,
                    batch_object_bucket: bucket.clone(),
                    consumer_name: consumer.clone(),
                    ingest_batch: ingest,
                    fetch_wait: Duration::from_nanos(fetch_ns),
                    ack_wait,
                    max_ack_pending: (ingest + extra_pending).min(1_000_000),
                    max_request_wait: max_wait,
                    state_log_compact_bytes: compact,
                    min_reward_spread: min_spread,
                })
            },
        )
}

fn learner() -> impl Strategy<Value = LearnerConfig> {
    (
        (
            prop_oneof![
                Just(ProximalName::Recompute),
                Just(ProximalName::Approx),
                Just(ProximalName::Behaviour)
            ],
            prop_oneof![
                Just(AdvantageNormName::Mean),
                Just(AdvantageNormName::MeanStd),
                Just(AdvantageNormName::LeaveOneOut)
            ],
            prop_oneof![
                Just(LossAggregationName::Token),
                Just(LossAggregationName::Sequence)
            ],
            0.0f64..=100.0,
            1usize..=1024,
            0usize..=u32::MAX as usize,
            0..=i64::MAX as u64,
        ),
        (
            0.0f64..=1.0,
            0.0f64..=0.999_999,
            0.0f64..=0.999_999_9,
            1e-20f64..=1.0,
            0.0f64..=1e6,
            0.0f64..=100.0,
            prop_oneof![Just(KlEstimatorName::K1), Just(KlEstimatorName::K3)],
            (
                any::<bool>(),
                any::<bool>(),
                any::<bool>(),
                0usize..=u32::MAX as usize,
            ),
        ),
        (
            proptest::option::of(path()),
            1..=i64::MAX as u64,
            1usize..=1000,
            1usize..=1000,
            (dur_ms(1, 60_000), dur_ms(100, 3_599_999)),
            proptest::collection::vec(0usize..1024, 0..4),
        ),
        (
            1usize..=4096,
            path(),
            prop_oneof![
                Just(MixedPrecisionName::Auto),
                Just(MixedPrecisionName::None),
                Just(MixedPrecisionName::Bf16)
            ],
            any::<bool>(),
            any::<bool>(),
            dur_ms(1, 3_600_000),
        ),
    )
        .prop_map(
            |(
                (proximal, norm, agg, m2po, minibatches, max_tokens, warmup),
                (
                    wd,
                    beta1,
                    beta2,
                    eps,
                    clip,
                    kl_coef,
                    kl_estimator,
                    (packing, share_prefixes, forward_only_zero_advantage, packing_lane_tokens),
                ),
                (ckpt_dir, ckpt_every, keep_ckpt, keep_versions, (poll, lease_ttl), cores),
                (world_size, python, mixed_precision, checkpointing, offload, start_timeout),
            )| LearnerConfig {
                // The torch engine's world size must divide the batch (a
                // cross-section check with its own tests); its section
                // round-trips either way.
                trainer: TrainerEngineName::Builtin,
                torch: TorchEngineConfig {
                    world_size,
                    // `nodes` divides `world_size` and is at most 512.
                    nodes: if world_size.is_multiple_of(8) { 8 } else { 1 },
                    rendezvous: Some(format!("trainer-{world_size}.asyncrl:29500")),
                    python,
                    mixed_precision,
                    activation_checkpointing: checkpointing,
                    cpu_offload: offload,
                    start_timeout,
                },
                weight_transport: WeightTransportName::ObjectStore,
                shared_weights_dir: None,
                proximal,
                advantage_norm: norm,
                loss_aggregation: agg,
                m2po_threshold: m2po,
                kl_coef,
                kl_estimator,
                minibatches,
                max_tokens_per_microbatch: max_tokens,
                packing,
                share_prefixes,
                forward_only_zero_advantage,
                packing_lane_tokens,
                warmup_steps: warmup,
                weight_decay: wd,
                beta1,
                beta2,
                adam_eps: eps,
                grad_clip: clip,
                checkpoint_dir: ckpt_dir,
                checkpoint_every: ckpt_every,
                keep_checkpoints: keep_ckpt,
                keep_weight_versions: keep_versions,
                batch_poll_interval: poll,
                lease_ttl,
                cpu_affinity: cores,
            },
        )
}

fn engine() -> impl Strategy<Value = EngineConfig> {
    let endpoints_launch = prop_oneof![
        proptest::collection::vec("https?://[a-z0-9.]{1,10}:[0-9]{2,5}", 1..4)
            .prop_map(|e| (e, Vec::new())),
        (
            "http://127\\.0\\.0\\.1:[0-9]{4}",
            proptest::collection::vec(text(), 1..4)
        )
            .prop_map(|(e, l)| (vec![e], l)),
    ];
    let vllm = (
        endpoints_launch,
        path(),
        prop_oneof![
            Just((PauseMode::Abort, EngineApi::Auto)),
            Just((PauseMode::Abort, EngineApi::Completions)),
            Just((PauseMode::Keep, EngineApi::Generate)),
            Just((PauseMode::Keep, EngineApi::Auto)),
            Just((PauseMode::Abort, EngineApi::Generate)),
        ],
    )
        .prop_map(|((endpoints, launch), weights_dir, (pause_mode, api))| {
            (
                EngineKind::Vllm,
                endpoints,
                launch,
                weights_dir,
                pause_mode,
                api,
            )
        });
    let builtin = (path(), any::<bool>()).prop_map(|(weights_dir, keep)| {
        let pause_mode = if keep {
            PauseMode::Keep
        } else {
            PauseMode::Abort
        };
        (
            EngineKind::Builtin,
            Vec::new(),
            Vec::new(),
            weights_dir,
            pause_mode,
            EngineApi::Generate,
        )
    });
    (
        prop_oneof![builtin, vllm],
        dur_ms(1, 3_600_000),
        dur_ms(1, 3_600_000),
        dur_ms(1, 3_600_000),
    )
        .prop_map(
            |((kind, endpoints, launch, weights_dir, pause_mode, api), ready, request, control)| {
                EngineConfig {
                    kind,
                    endpoints,
                    launch,
                    weights_dir,
                    pause_mode,
                    api,
                    ready_timeout: ready,
                    request_timeout: request,
                    control_timeout: control,
                }
            },
        )
}

fn worker() -> impl Strategy<Value = WorkerConfig> {
    let reward = (
        proptest::option::of("https?://[a-z0-9.]{1,10}:[0-9]{2,5}"),
        dur_ms(1, 60_000),
        1u32..=100,
        dur_ms(0, 60_000),
        1usize..=4096,
    )
        .prop_map(
            |(endpoint, timeout, attempts, backoff, concurrency)| WorkerRewardConfig {
                endpoint,
                timeout,
                attempts,
                backoff,
                concurrency,
            },
        );
    (
        (
            proptest::option::of(name()),
            1usize..=4096,
            0usize..=4096,
            prop_oneof![Just(BatchingMode::Continuous), Just(BatchingMode::Static)],
            dur_ms(1, 60_000),
            dur_ms(1, 10_000),
            0u32..=10,
        ),
        (
            dur_ms(0, 600_000),
            dur_ms(1, 600_000),
            dur_ms(1, 10_000),
            0u32..=10,
            dur_ms(1, 60_000),
            proptest::collection::vec(0usize..1024, 0..4),
            any::<bool>(),
        ),
        reward,
        engine(),
    )
        .prop_map(
            |(
                (id, max_sequences, in_flight, batching, heartbeat, acquire_min, acquire_x),
                (drain, fetch_timeout, weight_min, weight_x, metrics, cores, share_prompts),
                reward,
                engine,
            )| WorkerConfig {
                id,
                max_sequences,
                share_prompts,
                max_tasks_in_flight: in_flight,
                batching,
                heartbeat_interval: heartbeat,
                acquire_backoff_min: acquire_min,
                acquire_backoff_max: acquire_min * (acquire_x + 1),
                drain_grace_period: drain,
                weight_fetch_timeout: fetch_timeout,
                weight_retry_backoff_min: weight_min,
                weight_retry_backoff_max: weight_min * (weight_x + 1),
                metrics_interval: metrics,
                cpu_affinity: cores,
                reward,
                engine,
            },
        )
}

fn eval() -> impl Strategy<Value = EvalConfig> {
    (
        (0..=i64::MAX as u64, proptest::option::of(dataset(true))),
        (1usize..=1 << 40, 0.0f64..=1.0),
        (any::<bool>(), 0usize..=1024),
        proptest::option::of(prop_oneof![Just(100.0f64), 1e-6f64..100.0]),
        0..=i64::MAX as u64,
        (
            proptest::option::of(1usize..=1 << 16),
            prop_oneof![Just(EvalEngineName::Auto), Just(EvalEngineName::Builtin)],
            0u8..=19,
        ),
    )
        .prop_map(
            |(
                (every, dataset),
                (max_problems, share),
                (greedy, samples),
                temperature,
                seed,
                (new, engine, nice),
            )| {
                EvalConfig {
                    every_steps: if dataset.is_some() { every } else { 0 },
                    dataset,
                    problems: (max_problems as f64 * share) as usize,
                    max_problems,
                    greedy: greedy || samples == 0,
                    samples,
                    temperature,
                    seed,
                    max_new_tokens: new,
                    // `torch` needs model.path (a cross-section check with
                    // its own tests).
                    engine,
                    nice,
                }
            },
        )
}

fn config() -> impl Strategy<Value = Config> {
    (
        (
            run().boxed(),
            staleness().boxed(),
            bus().boxed(),
            telemetry().boxed(),
            model().boxed(),
        ),
        (
            coordinator().boxed(),
            buffer().boxed(),
            learner().boxed(),
            worker().boxed(),
            eval().boxed(),
        ),
    )
        .prop_map(
            |(
                (run, staleness, bus, telemetry, model),
                (coordinator, buffer, learner, worker, eval),
            )| {
                Config {
                    run,
                    staleness,
                    bus,
                    telemetry,
                    model,
                    coordinator,
                    buffer,
                    learner,
                    worker,
                    eval,
                    environment: None,
                }
            },
        )
}

#[test]
fn random_valid_configs_round_trip() {
    // The strategy of a whole config nests deeply; unoptimised builds need
    // more than a test thread's default stack to generate it.
    std::thread::Builder::new()
        .stack_size(256 << 20)
        .spawn(random_valid_configs)
        .expect("spawn")
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e));
}

fn random_valid_configs() {
    const CASES: u32 = 512;
    let tried = AtomicUsize::new(0);
    // How many cases set a key away from its default, per section: each
    // must be reached, or the generator does not cover it.
    let differs: [AtomicUsize; 10] = Default::default();
    let default = Config::default();
    let mut runner = TestRunner::new(ProptestConfig {
        cases: CASES,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    runner
        .run(&config(), |config| {
            tried.fetch_add(1, Ordering::Relaxed);
            config
                .validate()
                .map_err(|e| TestCaseError::fail(format!("generated an invalid config: {e}")))?;
            for (i, d) in [
                config.run != default.run,
                config.staleness != default.staleness,
                config.bus != default.bus,
                config.telemetry != default.telemetry,
                config.model != default.model,
                config.coordinator != default.coordinator,
                config.buffer != default.buffer,
                config.learner != default.learner,
                config.worker != default.worker,
                config.eval != default.eval,
            ]
            .into_iter()
            .enumerate()
            {
                if d {
                    differs[i].fetch_add(1, Ordering::Relaxed);
                }
            }
            assert_round_trip(&config).map_err(TestCaseError::fail)
        })
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(tried.load(Ordering::Relaxed), CASES as usize);
    for (i, d) in differs.iter().enumerate() {
        assert!(
            d.load(Ordering::Relaxed) > CASES as usize / 2,
            "section {i} is mostly default"
        );
    }
}

/// A table over single non-default values, one per key kind, each checked
/// on its own so that a failure names the key.
#[test]
fn single_non_default_keys_round_trip() {
    let base = || Config::isolated("out", "nats://127.0.0.1:4222");
    let cases: Vec<(&str, Config)> = vec![
        ("a duration with nanoseconds", {
            let mut c = base();
            c.bus.connect_timeout = Duration::new(3, 500_000_007);
            c
        }),
        ("a sub-millisecond duration", {
            let mut c = base();
            c.buffer.fetch_wait = Duration::from_micros(1500);
            c
        }),
        ("a duration of days", {
            let mut c = base();
            c.bus.storage.dead_letters_max_age = Duration::from_secs(40 * 24 * 3600 + 1);
            c
        }),
        ("a zero duration", {
            let mut c = base();
            c.worker.drain_grace_period = Duration::ZERO;
            c
        }),
        ("a renamed enum (snake_case)", {
            let mut c = base();
            c.buffer.sampling = SamplingPolicy::FreshFirst;
            c.learner.advantage_norm = AdvantageNormName::MeanStd;
            c
        }),
        ("a renamed enum (lowercase)", {
            let mut c = base();
            c.coordinator.initial_knobs.clip_mode = ClipModeName::M2po;
            c.model.weight_dtype = WeightDtypeName::Bf16;
            c
        }),
        ("an optional key set", {
            let mut c = base();
            c.buffer.sampling = SamplingPolicy::Reuse;
            c.buffer.reuse_max = Some(7);
            c.eval.max_new_tokens = Some(3);
            c
        }),
        ("a data set with every field set", {
            let mut c = base();
            let mut d = DatasetConfig::jsonl("gsm8k", "data/gsm8k.parquet");
            d.format = DatasetFormat::Parquet;
            d.prompt_field = "question".into();
            d.answer_field = "final".into();
            d.id_field = "uid".into();
            d.apply_chat_template = true;
            d.system_prompt = Some("Think.\n\"Answer\" at the end.".into());
            d.verifier = Some("math".into());
            d.max_prompt_tokens = Some(512);
            d.long_prompts = LongPrompts::Skip;
            c.coordinator.datasets = vec![d.clone(), DatasetConfig::jsonl("arith", "a.jsonl")];
            c.eval.every_steps = 5;
            c.eval.dataset = Some(d);
            c
        }),
        ("role tables and TLS", {
            let mut c = base();
            c.bus.token_file = Some("/s/token".into());
            c.bus.tls = Some(TlsConfig {
                required: true,
                ca_file: Some("/ca.pem".into()),
                ..TlsConfig::default()
            });
            c.bus.roles.insert(
                "worker".into(),
                RoleAuth {
                    user: Some("worker".into()),
                    password: Some(Secret::new("w")),
                    ..RoleAuth::default()
                },
            );
            c.bus.roles.insert(
                "learner".into(),
                RoleAuth {
                    tls: Some(TlsConfig {
                        cert_file: Some("/l.pem".into()),
                        key_file: Some("/l.key".into()),
                        ..TlsConfig::default()
                    }),
                    ..RoleAuth::default()
                },
            );
            c
        }),
        ("the admin API with token and TLS", {
            let mut c = base();
            c.coordinator.admin_listen = "0.0.0.0:7461".into();
            c.coordinator.admin_token = Some("admin".into());
            c.coordinator.admin_tls = Some(AdminTlsConfig {
                cert_file: Some("/c.pem".into()),
                key_file: Some("/c.key".into()),
                ca_file: None,
                domain: Some("coordinator".into()),
            });
            c
        }),
        ("the vLLM engine", {
            let mut c = base();
            c.worker.engine.kind = EngineKind::Vllm;
            c.worker.engine.endpoints = vec!["http://127.0.0.1:8000".into()];
            c.worker.engine.launch = vec!["python".into(), "-m".into(), "vllm".into()];
            c.worker.engine.pause_mode = PauseMode::Keep;
            c.worker.engine.api = EngineApi::Generate;
            c
        }),
        ("floats that need their exponent", {
            let mut c = base();
            c.coordinator.initial_knobs.learning_rate = 3e-9;
            c.learner.adam_eps = 1e-20;
            c.model.temperature = 0.1 + 0.2;
            c
        }),
        ("stop conditions", {
            let mut c = base();
            c.model.stop_token_ids = vec![0, 151_643];
            c.model.stop_strings = vec!["</answer>".into(), "\n\n".into(), "\\".into()];
            c
        }),
    ];
    for (what, config) in cases {
        assert_ne!(config, base(), "{what}: sets nothing");
        config.validate().unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_round_trip(&config).unwrap_or_else(|e| panic!("{what}: {e}"));
    }
}
