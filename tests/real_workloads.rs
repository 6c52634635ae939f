//! Real workloads through the binary: a Hugging Face model folder with a
//! chat template, data sets in the layout of Hugging Face exports (Parquet,
//! messages), stop strings, and `asyncrl train --check-config` on the
//! shipped GSM8K example. The model is a stand-in made here (a tiny Qwen2
//! with the built-in character tokenizer and random weights): the code
//! paths are those of a real model, only the sizes differ.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;

use arrow::array::{ArrayRef, ListArray, RecordBatch, StringArray, StructArray};
use arrow::buffer::OffsetBuffer;
use arrow::datatypes::{DataType, Field, Fields};
use asyncrl_config::{Config, DatasetConfig, DeviceName};
use asyncrl_harness::configs;
use asyncrl_protos::v1::FinishReason;
use asyncrl_text::{Message, ModelText, Prompt};

/// Stop strings: a sixth of the characters the random stand-in samples, so
/// that most completions of 6 tokens meet one.
const STOPS: [&str; 16] = [
    "\n", " ", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "a", "e", "o", "=",
];

/// A chat template over the built-in character vocabulary, shaped like
/// Qwen2.5's (a default system prompt, role headers, a generation prompt).
const TEMPLATE: &str = "{% if messages[0]['role'] != 'system' %}[system]\nYou are a calculator.\n{% endif %}{% for m in messages %}[{{ m['role'] }}]\n{{ m['content'] | trim }}\n{% endfor %}{% if add_generation_prompt %}[assistant]\n{% endif %}";

fn asyncrl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_asyncrl"))
        .args(args)
        .env("NO_COLOR", "1")
        .env_remove("RUST_LOG")
        .output()
        .expect("run asyncrl")
}

fn ok(args: &[&str], out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "asyncrl {args:?} failed\nstdout: {stdout}\nstderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// A tiny Qwen2 model folder: random weights, the built-in tokenizer, and
/// (when `template`) a `chat_template.jinja`; `generation_config.json`
/// names its EOS.
fn stand_in_model(dir: &Path, template: bool) -> PathBuf {
    let tok = asyncrl_policy::PolicyTokenizer::builtin();
    let id = |t: &str| tok.token_to_id(t).expect("built-in token");
    let cfg = asyncrl_policy::ModelConfig::from_json(&serde_json::json!({
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": tok.vocab_size(),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": true,
        "bos_token_id": id("<bos>"),
        "eos_token_id": id("<eos>"),
        "hidden_act": "silu",
    }))
    .expect("a stand-in config");
    let mut policy =
        asyncrl_policy::Policy::random_init(cfg, 11, 0.02, asyncrl_policy::DeviceOptions::cpu())
            .expect("random weights");
    policy.set_tokenizer(Some(tok));
    let out = dir.join(if template {
        "chat-model"
    } else {
        "plain-model"
    });
    policy.save_pretrained(&out, None).expect("save the model");
    // The built-in tokenizer's config, without its chat template: the plain
    // model has none, the chat model gets `chat_template.jinja`.
    let mut tokenizer_config: serde_json::Value =
        serde_json::from_slice(&asyncrl_text::builtin_tokenizer_config()).expect("json");
    if let Some(fields) = tokenizer_config.as_object_mut() {
        fields.remove("chat_template");
    }
    std::fs::write(
        out.join("tokenizer_config.json"),
        serde_json::to_vec_pretty(&tokenizer_config).expect("json"),
    )
    .expect("tokenizer_config.json");
    if template {
        std::fs::write(out.join("chat_template.jinja"), TEMPLATE).expect("template");
    }
    out
}

/// A list<struct<role, content>> column, as `datasets` writes messages.
fn messages_column(rows: &[Vec<(&str, &str)>]) -> ArrayRef {
    let fields = Fields::from(vec![
        Field::new("role", DataType::Utf8, false),
        Field::new("content", DataType::Utf8, false),
    ]);
    let flat: Vec<(&str, &str)> = rows.iter().flatten().copied().collect();
    let roles: ArrayRef = Arc::new(StringArray::from_iter_values(flat.iter().map(|m| m.0)));
    let contents: ArrayRef = Arc::new(StringArray::from_iter_values(flat.iter().map(|m| m.1)));
    Arc::new(ListArray::new(
        Arc::new(Field::new("item", DataType::Struct(fields.clone()), false)),
        OffsetBuffer::from_lengths(rows.iter().map(Vec::len)),
        Arc::new(StructArray::new(fields, vec![roles, contents], None)),
        None,
    ))
}

fn write_parquet(path: &Path, columns: Vec<(&str, ArrayRef)>) {
    let batch = RecordBatch::try_from_iter(columns).expect("a record batch");
    let file = std::fs::File::create(path).expect("create parquet");
    let mut w =
        parquet::arrow::ArrowWriter::try_new(file, batch.schema(), None).expect("parquet writer");
    w.write(&batch).expect("write parquet");
    w.close().expect("close parquet");
}

/// Chat prompts of small sums, with the final answer as GSM8K writes it.
fn chat_rows() -> (Vec<Vec<(String, String)>>, Vec<String>) {
    let mut prompts = Vec::new();
    let mut answers = Vec::new();
    for i in 0..12u32 {
        let (a, b) = (i % 7 + 1, i % 5 + 2);
        let mut m = Vec::new();
        if i % 2 == 0 {
            m.push(("system".to_owned(), "Answer with a number.".to_owned()));
        }
        m.push(("user".to_owned(), format!("What is {a}+{b}?")));
        prompts.push(m);
        answers.push(format!("{a} + {b} = {}\n#### {}", a + b, a + b));
    }
    (prompts, answers)
}

/// A three-step run of the stand-in `model` on `dataset`, in process.
fn config(out: &Path, model: &Path, dataset: DatasetConfig) -> Config {
    let mut c = Config::isolated(out, "local");
    c.run.name = "real-workloads".into();
    c.run.max_steps = 3;
    c.staleness.eta = 1;
    c.staleness.groups_per_step = 2;
    c.staleness.group_size = 2;
    c.telemetry.log_filter = "warn".into();
    c.model.path = Some(model.to_owned());
    c.model.device = DeviceName::Cpu;
    c.model.max_new_tokens = 6;
    c.model.max_seq_len = 96;
    c.model.cpu_threads = 1;
    c.coordinator.datasets = vec![dataset];
    c
}

#[test]
fn a_parquet_data_set_of_chat_messages_trains_end_to_end_with_the_models_template() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = stand_in_model(dir.path(), true);
    let (prompts, answers) = chat_rows();
    let data = dir.path().join("train-00000-of-00001.parquet");
    let rows: Vec<Vec<(&str, &str)>> = prompts
        .iter()
        .map(|m| m.iter().map(|(r, c)| (r.as_str(), c.as_str())).collect())
        .collect();
    write_parquet(
        &data,
        vec![
            ("messages", messages_column(&rows)),
            (
                "answer",
                Arc::new(StringArray::from(answers.clone())) as ArrayRef,
            ),
        ],
    );
    let out = dir.path().join("out");
    let mut config = config(
        &out,
        &model,
        DatasetConfig {
            prompt_field: "messages".into(),
            verifier: Some("math".into()),
            max_prompt_tokens: Some(80),
            ..DatasetConfig::jsonl("sums", &data)
        },
    );
    config.model.stop_strings = STOPS.iter().map(|s| s.to_string()).collect();
    let config = configs::write(&config, dir.path().join("chat.toml"));
    let config = config.to_str().expect("utf-8 path");

    // The check renders every prompt with the template.
    let args = ["train", config, "--check-config"];
    let report = ok(&args, &asyncrl(&args));
    assert!(report.contains("chat template: yes"), "{report}");
    assert!(
        report.contains("data set `sums`") && report.contains("12 tasks, verifier math"),
        "{report}"
    );
    assert!(
        report.contains("[system]\n    | Answer with a number.\n    | [user]\n    | What is 1+2?\n    | [assistant]"),
        "the first prompt, rendered: {report}"
    );
    assert!(!out.exists(), "--check-config runs nothing");

    let args = ["train", config];
    let summary = ok(&args, &asyncrl(&args));
    assert!(summary.contains("trained 3 steps"), "{summary}");

    // What the learner trained on: every prompt is one of the data set's
    // message lists through the model's template, token for token.
    let export = dir.path().join("export.parquet");
    let args = [
        "buffer",
        "export",
        "--config",
        config,
        "--out",
        export.to_str().expect("utf-8 path"),
    ];
    ok(&args, &asyncrl(&args));
    let text = ModelText::from_dir(&model).expect("the model's text side");
    let expected: Vec<Vec<i32>> = prompts
        .iter()
        .map(|m| {
            let p = Prompt::Messages(m.iter().map(|(r, c)| Message::new(r, c)).collect());
            text.encode(&p)
                .expect("encode")
                .into_iter()
                .map(|t| t as i32)
                .collect()
        })
        .collect();
    let file = std::fs::File::open(&export).expect("open the export");
    let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
        .expect("read the export")
        .build()
        .expect("reader");
    let mut seen = 0;
    let mut stopped_by_string = 0;
    for batch in reader {
        let batch = batch.expect("a batch");
        for t in asyncrl_protos::arrow_schema::from_record_batch(&batch).expect("trajectories") {
            assert!(
                expected.contains(&t.prompt_token_ids),
                "prompt {:?} is no templated data-set prompt",
                t.prompt_token_ids
            );
            // A stop string ends the completion at the token completing it.
            if t.finish_reason == FinishReason::StopString as i32 {
                stopped_by_string += 1;
                let ids: Vec<i64> = t.completion_token_ids.iter().map(|&x| x.into()).collect();
                let full = text.tokenizer().decode(&ids, true).expect("decode");
                let short = text
                    .tokenizer()
                    .decode(&ids[..ids.len() - 1], true)
                    .expect("decode");
                let holds = |s: &str| STOPS.iter().any(|x| s.contains(x));
                assert!(holds(&full) && !holds(&short), "{full:?} / {short:?}");
            }
            assert_eq!(t.completion_token_ids.len(), t.behaviour_logprobs.len());
            seen += 1;
        }
    }
    assert!(seen >= 3 * 2 * 2, "{seen} trajectories");
    // With 16 of ~100 characters stopping, P(no stop in 6 tokens) ≈ 0.35
    // per completion; over ≥ 12 completions some stop.
    assert!(
        stopped_by_string > 0,
        "no completion ended at the stop string"
    );
}

#[test]
fn messages_for_a_model_without_a_chat_template_are_one_error_line() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = stand_in_model(dir.path(), false);
    let data = dir.path().join("chat.jsonl");
    std::fs::write(
        &data,
        "{\"prompt\": [{\"role\": \"user\", \"content\": \"1+1=\"}], \"answer\": \"2\"}\n",
    )
    .expect("write data");
    let out = dir.path().join("out");
    let config = configs::write(
        &config(&out, &model, DatasetConfig::jsonl("chat", &data)),
        dir.path().join("c.toml"),
    );
    let config = config.to_str().expect("utf-8 path");
    for args in [
        vec!["train", config, "--check-config"],
        vec!["train", config],
    ] {
        let o = asyncrl(&args);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(stderr.contains("no chat template"), "{stderr}");
        // The data set is measured at load: the error names the model, the
        // file and the row.
        assert!(
            stderr.contains("plain-model") && stderr.contains("chat.jsonl, line 1"),
            "{stderr}"
        );
    }
    assert!(!out.join("learner_metrics.csv").exists());
}

#[test]
fn the_gsm8k_example_passes_check_config_with_a_stand_in_model() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = stand_in_model(dir.path(), true);
    // GSM8K's layout: `question`, and `answer` with the final answer after ####.
    let data = dir.path().join("gsm8k.parquet");
    write_parquet(
        &data,
        vec![
            (
                "question",
                Arc::new(StringArray::from(vec![
                    "Tom has 3 apples and buys 4 more. How many apples does he have?",
                    "A box holds 6 eggs. How many eggs are in 7 boxes?",
                ])) as ArrayRef,
            ),
            (
                "answer",
                Arc::new(StringArray::from(vec![
                    "3 + 4 = <<3+4=7>>7\n#### 7",
                    "6 * 7 = <<6*7=42>>42\n#### 42",
                ])) as ArrayRef,
            ),
        ],
    );
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/gsm8k-qwen2.5.toml");
    let mut config = Config::load(&example).expect("the example is a valid config");
    assert!(config.model.path.is_some(), "the example names a model");
    config.model.path = Some(model.clone());
    let first = config
        .coordinator
        .datasets
        .first_mut()
        .expect("the example has [[coordinator.datasets]]");
    first.path = data.clone();
    let path = configs::write(&config, dir.path().join("gsm8k.toml"));
    let path = path.to_str().expect("utf-8 path");
    let args = ["train", path, "--check-config"];
    let report = ok(&args, &asyncrl(&args));
    assert!(report.contains("chat template: yes"), "{report}");
    assert!(report.contains("2 tasks, verifier math"), "{report}");
    assert!(
        report.contains("Tom has 3 apples"),
        "the first question, rendered: {report}"
    );
}
