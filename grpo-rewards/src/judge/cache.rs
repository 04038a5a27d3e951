//! The persistent judge cache: SQLite (WAL), keyed by a SHA-256 of everything that shapes the
//! reply.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use rusqlite::{Connection, OptionalExtension, params};
use sha2::{Digest, Sha256};

use crate::error::{Result, RewardError};

/// A reply cache in one SQLite file.
///
/// Writes are single autocommit transactions in WAL mode, so a reply is either fully stored or
/// absent after a crash, and a new process (or a new `JudgeCache` on the same file) sees every
/// reply an earlier one stored. Several judges may share a file; the key includes the base URL,
/// model and template.
pub struct JudgeCache {
    path: PathBuf,
    conn: Mutex<Connection>,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl std::fmt::Debug for JudgeCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JudgeCache")
            .field("path", &self.path)
            .field("hits", &self.hits())
            .field("misses", &self.misses())
            .finish()
    }
}

impl JudgeCache {
    /// Opens (creating when needed) the cache at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let err = |e: rusqlite::Error| RewardError::Cache {
            path: path.clone(),
            message: e.to_string(),
        };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| RewardError::Cache {
                path: path.clone(),
                message: format!("cannot create the folder: {e}"),
            })?;
        }
        let conn = Connection::open(&path).map_err(err)?;
        conn.busy_timeout(std::time::Duration::from_secs(10))
            .map_err(err)?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(err)?;
        conn.pragma_update(None, "synchronous", "NORMAL")
            .map_err(err)?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS judge_replies (
                key TEXT PRIMARY KEY NOT NULL,
                reply TEXT NOT NULL,
                created_unix INTEGER NOT NULL
            );",
        )
        .map_err(err)?;
        Ok(Self {
            path,
            conn: Mutex::new(conn),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The cache key of a request: SHA-256 (hex) of its canonical JSON description.
    pub fn key(description: &serde_json::Value) -> String {
        let mut h = Sha256::new();
        h.update(description.to_string().as_bytes());
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Connection>> {
        self.conn.lock().map_err(|_| RewardError::Cache {
            path: self.path.clone(),
            message: "the cache lock was poisoned by a panic".into(),
        })
    }

    /// The stored reply for `key`; counts a hit or a miss.
    pub fn get(&self, key: &str) -> Result<Option<String>> {
        let conn = self.lock()?;
        let got = conn
            .prepare_cached("SELECT reply FROM judge_replies WHERE key = ?1")
            .and_then(|mut st| {
                st.query_row(params![key], |r| r.get::<_, String>(0))
                    .optional()
            })
            .map_err(|e| RewardError::Cache {
                path: self.path.clone(),
                message: e.to_string(),
            })?;
        let counter = if got.is_some() {
            &self.hits
        } else {
            &self.misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        Ok(got)
    }

    /// Stores `reply` under `key` (replacing an older one).
    pub fn put(&self, key: &str, reply: &str) -> Result<()> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0);
        let conn = self.lock()?;
        conn.prepare_cached(
            "INSERT OR REPLACE INTO judge_replies (key, reply, created_unix) VALUES (?1, ?2, ?3)",
        )
        .and_then(|mut st| st.execute(params![key, reply, now]))
        .map_err(|e| RewardError::Cache {
            path: self.path.clone(),
            message: e.to_string(),
        })?;
        Ok(())
    }

    /// Number of stored replies.
    pub fn len(&self) -> Result<usize> {
        let conn = self.lock()?;
        conn.query_row("SELECT COUNT(*) FROM judge_replies", [], |r| {
            r.get::<_, i64>(0)
        })
        .map(|n| n as usize)
        .map_err(|e| RewardError::Cache {
            path: self.path.clone(),
            message: e.to_string(),
        })
    }

    /// True when nothing is stored.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Lookups that found a reply.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    /// Lookups that found nothing.
    pub fn misses(&self) -> u64 {
        self.misses.load(Ordering::Relaxed)
    }
}
