//! The per-version weight folders the engine reloads from.

use std::path::{Path, PathBuf};

use super::api::VllmError;

/// Writes `bytes` as `dir/v<version>/model.safetensors` (temp folder, then
/// rename) and removes older version folders.
pub(super) fn write_version_dir(
    root: &Path,
    version: i32,
    bytes: &[u8],
    tied_head: bool,
) -> Result<PathBuf, VllmError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| VllmError::Io { path, source }
    };
    let final_dir = root.join(format!("v{version}"));
    if final_dir.join("model.safetensors").is_file() {
        return Ok(final_dir);
    }
    let tmp = root.join(format!(".v{version}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    let file = tmp.join("model.safetensors");
    let with_head;
    let bytes = if tied_head {
        with_head = with_tied_head(bytes).map_err(|e| VllmError::Io {
            path: file.clone(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
        })?;
        with_head.as_deref().unwrap_or(bytes)
    } else {
        bytes
    };
    std::fs::write(&file, bytes).map_err(io(&file))?;
    if final_dir.exists() {
        std::fs::remove_dir_all(&final_dir).map_err(io(&final_dir))?;
    }
    std::fs::rename(&tmp, &final_dir).map_err(io(&final_dir))?;
    Ok(final_dir)
}

/// The checkpoint with `lm_head.weight` = `model.embed_tokens.weight`
/// added, or None when it has its head already (or no embedding).
pub(super) fn with_tied_head(
    bytes: &[u8],
) -> Result<Option<Vec<u8>>, safetensors::SafeTensorError> {
    let st = safetensors::SafeTensors::deserialize(bytes)?;
    let names = st.names();
    if names.contains(&"lm_head.weight") {
        return Ok(None);
    }
    let Ok(embed) = st.tensor("model.embed_tokens.weight") else {
        return Ok(None);
    };
    let mut tensors: Vec<(String, safetensors::tensor::TensorView<'_>)> = st.tensors();
    tensors.push(("lm_head.weight".to_owned(), embed));
    safetensors::serialize(tensors, None).map(Some)
}

/// Removes every version folder (and stale temp folder) but `keep`.
pub(super) fn prune_version_dirs(root: &Path, keep: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if path == keep || !(name.starts_with('v') || name.starts_with(".v")) {
            continue;
        }
        if let Err(e) = std::fs::remove_dir_all(&path) {
            tracing::warn!(path = %path.display(), error = %e, "cannot remove an old weights folder");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tied_heads_are_written_out() {
        let embed: Vec<u8> = (0..24u8).collect();
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2, 3], &embed)
                .unwrap();
        let bytes = safetensors::serialize(vec![("model.embed_tokens.weight", view.clone())], None)
            .unwrap();
        let with = with_tied_head(&bytes).unwrap().unwrap();
        let st = safetensors::SafeTensors::deserialize(&with).unwrap();
        assert_eq!(st.tensor("lm_head.weight").unwrap().data(), &embed[..]);
        assert_eq!(
            st.tensor("model.embed_tokens.weight").unwrap().data(),
            &embed[..]
        );
        // A checkpoint with its own head stays as it is.
        assert!(with_tied_head(&with).unwrap().is_none());
        let root = tempfile::tempdir().unwrap();
        let dir = write_version_dir(root.path(), 3, &bytes, true).unwrap();
        let written = std::fs::read(dir.join("model.safetensors")).unwrap();
        assert_eq!(written, with);
    }

    #[test]
    fn version_folders_are_written_whole_and_old_ones_pruned() {
        let root = tempfile::tempdir().unwrap();
        let a = write_version_dir(root.path(), 1, b"one", false).unwrap();
        let b = write_version_dir(root.path(), 2, b"two", false).unwrap();
        assert_eq!(std::fs::read(b.join("model.safetensors")).unwrap(), b"two");
        std::fs::create_dir_all(root.path().join(".v3.tmp-1")).unwrap();
        std::fs::write(root.path().join("unrelated.txt"), b"x").unwrap();
        prune_version_dirs(root.path(), &b);
        assert!(!a.exists());
        assert!(b.exists());
        assert!(!root.path().join(".v3.tmp-1").exists());
        assert!(root.path().join("unrelated.txt").exists());
    }
}
