use std::path::Path;
use std::sync::Arc;

use arrow::array::{
    ArrayRef, Int64Array, LargeStringArray, ListArray, RecordBatch, StringArray, StructArray,
};
use arrow::buffer::OffsetBuffer;
use arrow::datatypes::{Field, Fields};
use asyncrl_config::{DatasetConfig, LongPrompts};
use asyncrl_text::{Message, ModelText, Prompt};

use super::*;

fn jsonl(dir: &tempfile::TempDir, text: &str) -> DatasetConfig {
    let path = dir.path().join("tasks.jsonl");
    std::fs::write(&path, text).unwrap();
    DatasetConfig::jsonl("t", path)
}

/// One case: a JSONL text and a mapping tweak, expecting `Ok(n items)` or
/// an error holding every given fragment (the file is always named).
fn check(text: &str, tweak: impl Fn(&mut DatasetConfig), expect: Result<usize, &[&str]>) {
    let dir = tempfile::tempdir().unwrap();
    let mut d = jsonl(&dir, text);
    tweak(&mut d);
    let got = load_dataset(&d, Some(&ModelText::builtin()));
    match (got, expect) {
        (Ok(l), Ok(n)) => assert_eq!(l.items.len(), n, "{text:?}"),
        (Err(e), Err(want)) => {
            let msg = e.to_string();
            assert!(
                msg.contains("tasks.jsonl"),
                "error should name the file: {msg}"
            );
            for w in want {
                assert!(msg.contains(w), "{text:?}: `{msg}` should contain `{w}`");
            }
        }
        (got, want) => panic!("{text:?}: expected {want:?}, got {got:?}"),
    }
}

fn same(_: &mut DatasetConfig) {}

#[test]
fn jsonl_table() {
    check(r#"{"prompt":"1+1=","answer":"2"}"#, same, Ok(1));
    check(
        "{\"prompt\":\"a\",\"answer\":\"b\"}\n\n{\"prompt\":\"c\",\"answer\":3}\n",
        same,
        Ok(2),
    );
    check(r#"{"prompt":"a","answer":"b","level":3}"#, same, Ok(1));
    check("", same, Err(&["holds no task"]));
    check("\n  \n", same, Err(&["holds no task"]));
    check(
        "{\"prompt\":\"a\",\"answer\":\"b\"}\n{oops",
        same,
        Err(&["line 2", "not valid JSON"]),
    );
    check("[1, 2]", same, Err(&["line 1", "expected a JSON object"]));
    check(
        r#"{"answer":"y"}"#,
        same,
        Err(&["line 1", "field `prompt`", "missing"]),
    );
    check(
        r#"{"prompt":"x"}"#,
        same,
        Err(&["field `answer`", "missing"]),
    );
    check(
        r#"{"prompt":"x","answer":null}"#,
        same,
        Err(&["field `answer`", "missing"]),
    );
    check(
        r#"{"prompt":3,"answer":"y"}"#,
        same,
        Err(&["field `prompt`", "found a number"]),
    );
    check(
        r#"{"prompt":"  ","answer":"y"}"#,
        same,
        Err(&["field `prompt`", "empty"]),
    );
    check(
        "\n\n{\"prompt\":\"x\",\"answer\":[1]}",
        same,
        Err(&["line 3", "field `answer`", "found a list"]),
    );
    check(
        r#"{"id":"a.b","prompt":"x","answer":"y"}"#,
        same,
        Err(&["field `id`", "NATS subject token"]),
    );
    check(r#"{"id":7,"prompt":"x","answer":"y"}"#, same, Ok(1));
    check(
        r#"{"id":true,"prompt":"x","answer":"y"}"#,
        same,
        Err(&["field `id`", "found a boolean"]),
    );
    check(
        "{\"id\":\"x\",\"prompt\":\"a\",\"answer\":\"b\"}\n{\"id\":\"x\",\"prompt\":\"c\",\"answer\":\"d\"}",
        same,
        Err(&[
            "`x` appears twice",
            "tasks.jsonl line 1",
            "tasks.jsonl line 2",
        ]),
    );
    // Messages.
    check(
        r#"{"prompt":[{"role":"user","content":"q"}],"answer":"a"}"#,
        same,
        Ok(1),
    );
    check(
        r#"{"prompt":[],"answer":"a"}"#,
        same,
        Err(&["field `prompt`", "message list is empty"]),
    );
    check(
        r#"{"prompt":[{"role":"robot","content":"q"}],"answer":"a"}"#,
        same,
        Err(&["field `prompt`", "robot"]),
    );
    check(
        r#"{"prompt":[{"role":"user"}],"answer":"a"}"#,
        same,
        Err(&["field `prompt`", "not a list of"]),
    );
    check(
        r#"{"prompt":[{"role":"user","content":"q","extra":1}],"answer":"a"}"#,
        same,
        Err(&["field `prompt`", "extra"]),
    );
    check(
        r#"{"prompt":{"role":"user"},"answer":"a"}"#,
        same,
        Err(&["found an object"]),
    );
    // A mapping of GSM8K's fields.
    let gsm8k = |d: &mut DatasetConfig| {
        d.prompt_field = "question".into();
        d.id_field = "uid".into();
    };
    check(
        r#"{"question":"How many?","answer":"3 + 4 = 7\n#### 7"}"#,
        gsm8k,
        Ok(1),
    );
    check(
        r#"{"prompt":"How many?","answer":"7"}"#,
        gsm8k,
        Err(&["field `question`", "missing"]),
    );
    check(r#"{"question":"q","answer":"7","uid":"g-1"}"#, gsm8k, Ok(1));
    // A system prompt needs a chat template for text prompts.
    check(
        r#"{"prompt":"q","answer":"a"}"#,
        |d| d.system_prompt = Some("Be brief.".into()),
        Err(&["field `prompt`", "apply_chat_template"]),
    );
}

#[test]
fn ids_count_rows_and_survive_skipped_prompts() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = jsonl(
        &dir,
        "{\"prompt\":\"1+1=\",\"answer\":\"2\"}\n\n{\"prompt\":\"123456789+1=\",\"answer\":\"123456790\"}\n{\"id\":\"mine\",\"prompt\":\"2+2=\",\"answer\":4}\n{\"prompt\":\"3+3=\",\"answer\":\"6\"}\n",
    );
    let text = ModelText::builtin();
    let all = load_dataset(&d, Some(&text)).unwrap();
    let ids: Vec<&str> = all.items.iter().map(|i| i.id.as_str()).collect();
    assert_eq!(ids, ["t-0", "t-1", "mine", "t-3"]);
    assert_eq!(all.items[2].answer, "4");
    assert_eq!(
        all.items[0].verifier, "service",
        "`t` is no built-in verifier"
    );
    assert_eq!(all.longest_prompt, None, "no limit, no measuring");

    // "123456789+1=" is 12 characters + BOS = 13 tokens; "1+1=" is 5.
    d.max_prompt_tokens = Some(12);
    let err = load_dataset(&d, Some(&text)).unwrap_err().to_string();
    assert!(
        err.contains("line 3")
            && err.contains("13 tokens")
            && err.contains("max_prompt_tokens = 12"),
        "{err}"
    );
    d.long_prompts = LongPrompts::Skip;
    let kept = load_dataset(&d, Some(&text)).unwrap();
    let ids: Vec<&str> = kept.items.iter().map(|i| i.id.as_str()).collect();
    assert_eq!(ids, ["t-0", "mine", "t-3"], "ids do not shift");
    assert_eq!(kept.skipped_long, 1);
    assert_eq!(kept.longest_prompt, Some(5));
    d.max_prompt_tokens = Some(13);
    assert_eq!(load_dataset(&d, Some(&text)).unwrap().items.len(), 4);
    // Everything too long: an empty data set says why.
    d.max_prompt_tokens = Some(2);
    let err = load_dataset(&d, Some(&text)).unwrap_err().to_string();
    assert!(
        err.contains("4 prompts were over max_prompt_tokens"),
        "{err}"
    );
    // A limit without a tokenizer is refused.
    let err = load_dataset(&d, None).unwrap_err().to_string();
    assert!(err.contains("needs the model's tokenizer"), "{err}");
}

#[test]
fn messages_are_measured_after_the_template() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = jsonl(&dir, r#"{"prompt":"1+1=","answer":"2"}"#);
    d.apply_chat_template = true;
    d.system_prompt = Some("be".into());
    d.max_prompt_tokens = Some(100);
    // The built-in model's template: `<bos>`, then the contents, so the
    // prompt measures 1 + 2 + 4 tokens; a limit below that drops it.
    let loaded = load_dataset(&d, Some(&ModelText::builtin())).unwrap();
    assert_eq!(loaded.items.len(), 1);
    d.max_prompt_tokens = Some(6);
    let err = load_dataset(&d, Some(&ModelText::builtin()))
        .unwrap_err()
        .to_string();
    assert!(err.contains("over max_prompt_tokens"), "{err}");
    // Without a limit nothing is rendered at load time; the prompt is kept
    // as messages with the system prompt first.
    d.max_prompt_tokens = None;
    let items = load_dataset(&d, None).unwrap().items;
    assert_eq!(
        items[0].prompt,
        Prompt::Messages(vec![
            Message::new("system", "be"),
            Message::new("user", "1+1=")
        ])
    );
}

#[test]
fn duplicate_ids_across_data_sets_name_both() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.jsonl");
    let b = dir.path().join("b.jsonl");
    std::fs::write(&a, r#"{"id":"x","prompt":"p","answer":"1"}"#).unwrap();
    std::fs::write(&b, r#"{"id":"x","prompt":"q","answer":"2"}"#).unwrap();
    let err = load_datasets(
        &[DatasetConfig::jsonl("a", &a), DatasetConfig::jsonl("b", &b)],
        None,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("a.jsonl") && err.contains("b.jsonl") && err.contains("`x`"),
        "{err}"
    );
    assert!(matches!(
        load_datasets(&[], None),
        Err(TaskError::NoDatasets)
    ));
    let missing = DatasetConfig::jsonl("m", dir.path().join("nope.jsonl"));
    let err = load_dataset(&missing, None).unwrap_err().to_string();
    assert!(err.contains("nope.jsonl") && err.contains("`m`"), "{err}");
}

/// A list<struct<role, content>> column.
fn messages_column(rows: &[Option<Vec<(&str, &str)>>]) -> ArrayRef {
    let fields = Fields::from(vec![
        Field::new("role", arrow::datatypes::DataType::Utf8, false),
        Field::new("content", arrow::datatypes::DataType::Utf8, false),
    ]);
    let flat: Vec<(&str, &str)> = rows.iter().flatten().flatten().copied().collect();
    let roles: ArrayRef = Arc::new(StringArray::from_iter_values(flat.iter().map(|m| m.0)));
    let contents: ArrayRef = Arc::new(StringArray::from_iter_values(flat.iter().map(|m| m.1)));
    let structs = StructArray::new(fields.clone(), vec![roles, contents], None);
    let lens = rows.iter().map(|r| r.as_ref().map_or(0, Vec::len));
    let nulls =
        arrow::buffer::NullBuffer::from(rows.iter().map(Option::is_some).collect::<Vec<_>>());
    Arc::new(ListArray::new(
        Arc::new(Field::new(
            "item",
            arrow::datatypes::DataType::Struct(fields),
            false,
        )),
        OffsetBuffer::from_lengths(lens),
        Arc::new(structs),
        Some(nulls),
    ))
}

fn write_parquet(path: &Path, columns: Vec<(&str, ArrayRef)>) {
    let batch = RecordBatch::try_from_iter(columns).unwrap();
    let file = std::fs::File::create(path).unwrap();
    let mut w = parquet::arrow::ArrowWriter::try_new(file, batch.schema(), None).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
}

#[test]
fn parquet_in_the_layout_of_a_hugging_face_export() {
    let dir = tempfile::tempdir().unwrap();
    // GSM8K: `question` and `answer` strings, the final answer after ####.
    let gsm = dir.path().join("train-00000-of-00001.parquet");
    write_parquet(
        &gsm,
        vec![
            (
                "question",
                Arc::new(StringArray::from(vec![
                    "Tom has 3 apples and buys 4. How many?",
                    "What is 6*7?",
                ])) as ArrayRef,
            ),
            (
                "answer",
                Arc::new(StringArray::from(vec![
                    "3 + 4 = <<3+4=7>>7\n#### 7",
                    "#### 42",
                ])) as ArrayRef,
            ),
        ],
    );
    let mut d = DatasetConfig::jsonl("gsm8k", &gsm);
    d.prompt_field = "question".into();
    d.verifier = Some("math".into());
    let items = load_dataset(&d, None).unwrap().items;
    assert_eq!(items.len(), 2);
    assert_eq!(items[1].id, "gsm8k-1");
    assert_eq!(items[1].prompt, Prompt::Text("What is 6*7?".into()));
    assert_eq!(items[0].verifier, "math");
    assert!(matches!(
        crate::score("math", "So 3 + 4 = 7. #### 7", &items[0].answer),
        crate::Verdict::Reward(1.0)
    ));

    // Messages (list<struct<role, content>>), integer answers and ids, a
    // large-string column the mapping does not name.
    let chat = dir.path().join("chat.parquet");
    write_parquet(
        &chat,
        vec![
            (
                "messages",
                messages_column(&[
                    Some(vec![("system", "Be brief."), ("user", "2+2?")]),
                    Some(vec![("user", "héllo 世界 🙂")]),
                ]),
            ),
            (
                "solution",
                Arc::new(Int64Array::from(vec![4, -1])) as ArrayRef,
            ),
            ("idx", Arc::new(Int64Array::from(vec![10, 11])) as ArrayRef),
            (
                "source",
                Arc::new(LargeStringArray::from(vec!["a", "b"])) as ArrayRef,
            ),
        ],
    );
    let mut d = DatasetConfig::jsonl("chat", &chat);
    d.prompt_field = "messages".into();
    d.answer_field = "solution".into();
    d.id_field = "idx".into();
    let items = load_dataset(&d, None).unwrap().items;
    assert_eq!(items[0].id, "10");
    assert_eq!(items[1].answer, "-1");
    assert_eq!(
        items[0].prompt,
        Prompt::Messages(vec![
            Message::new("system", "Be brief."),
            Message::new("user", "2+2?")
        ])
    );
    assert_eq!(
        items[1].prompt,
        Prompt::Messages(vec![Message::new("user", "héllo 世界 🙂")])
    );

    // A missing column names the mapping key and the columns there are.
    d.answer_field = "answer".into();
    let err = load_dataset(&d, None).unwrap_err().to_string();
    assert!(
        err.contains("no column `answer`")
            && err.contains("answer_field")
            && err.contains("messages, solution, idx, source"),
        "{err}"
    );
    // A bad cell names the row and the field.
    let bad = dir.path().join("bad.parquet");
    write_parquet(
        &bad,
        vec![
            (
                "prompt",
                messages_column(&[Some(vec![("user", "q")]), None, Some(vec![])]),
            ),
            (
                "answer",
                Arc::new(StringArray::from(vec!["1", "2", "3"])) as ArrayRef,
            ),
        ],
    );
    let err = load_dataset(&DatasetConfig::jsonl("b", &bad), None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("bad.parquet, row 1, field `prompt`: missing"),
        "{err}"
    );
    // Not Parquet at all.
    let fake = dir.path().join("fake.parquet");
    std::fs::write(&fake, "{\"prompt\": \"x\", \"answer\": \"y\"}\n").unwrap();
    let err = load_dataset(&DatasetConfig::jsonl("f", &fake), None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("fake.parquet") && err.contains("not a readable Parquet file"),
        "{err}"
    );
    // ... but read as JSONL when the format says so.
    let mut d = DatasetConfig::jsonl("f", &fake);
    d.format = asyncrl_config::DatasetFormat::Jsonl;
    assert_eq!(load_dataset(&d, None).unwrap().items.len(), 1);
}

#[test]
fn generated_tasks_round_trip_through_jsonl() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sub/gen.jsonl");
    let items = crate::generate(crate::BuiltinTask::Arith, 50, 7);
    crate::write_jsonl(&path, &items).unwrap();
    let mut d = DatasetConfig::jsonl("arith", &path);
    d.max_prompt_tokens = Some(64);
    let loaded = load_dataset(&d, Some(&ModelText::builtin())).unwrap().items;
    assert_eq!(loaded, items);
}

#[test]
fn a_prompt_that_leaves_no_room_for_a_completion_is_refused_without_a_limit() {
    let dir = tempfile::tempdir().unwrap();
    // 13 tokens and 5 tokens (BOS included); no max_prompt_tokens.
    let mut d = jsonl(
        &dir,
        "{\"prompt\":\"1+1=\",\"answer\":\"2\"}\n{\"prompt\":\"123456789+1=\",\"answer\":\"123456790\"}\n",
    );
    let text = ModelText::builtin();
    // A context of 13 leaves the 13-token prompt no room for one token.
    let err = load_dataset_within(&d, Some(&text), Some(13))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("line 2")
            && err.contains("13 tokens")
            && err.contains("no room for a completion in model.max_seq_len = 13"),
        "{err}"
    );
    assert_eq!(
        load_dataset_within(&d, Some(&text), Some(14))
            .unwrap()
            .items
            .len(),
        2
    );
    // The tighter of the two bounds applies, and `skip` leaves it out.
    d.max_prompt_tokens = Some(100);
    let err = load_dataset_within(&d, Some(&text), Some(13))
        .unwrap_err()
        .to_string();
    assert!(err.contains("model.max_seq_len = 13"), "{err}");
    d.long_prompts = LongPrompts::Skip;
    let kept = load_dataset_within(&d, Some(&text), Some(13)).unwrap();
    assert_eq!((kept.items.len(), kept.skipped_long), (1, 1));
    // Without a tokenizer the context cannot be checked: refused.
    assert!(load_dataset_within(&d, None, Some(13)).is_err());
}
