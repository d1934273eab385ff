//! [`Store::backup`]: a consistent copy of the whole store file, taken while
//! the program runs.
//!
//! redb has no online backup of its own, and copying a file a writer is
//! changing can tear a commit. But a redb file that no writer touches is
//! the state of its last commit, complete: so the copy is made inside a
//! write transaction of the store's own that writes nothing and is never
//! committed. While it is open no other write of this store can begin (and
//! in a shared store, no write of any process: redb's write lock is the
//! file's), so the bytes copied are one commit, every table in it —
//! the store's and the application's own alike.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::store::Store;

impl Store {
    /// Copies the whole store file to `to`, a new file, while the program
    /// runs, and returns its length in bytes. The copy is one moment of
    /// the store: every commit made before the call, nothing of one made
    /// after it, and every table in the file, the application's own
    /// included (unlike `idemstore export`, which writes the store's own
    /// records as JSON). Open it with [`Store::open`] (or redb) like the
    /// original; redb may first run its repair on it, as after a crash,
    /// which keeps every commit.
    ///
    /// The store's writers (in a shared store, every process's) wait while
    /// the bytes are copied, about the time the file system takes to copy
    /// the file; readers do not. The copy is written beside `to` under a
    /// temporary name, synced, and renamed, so a crash during the backup
    /// never leaves a partial file at `to`. Under [`Durability::None`](crate::Durability::None)
    /// the store is [`sync`](Store::sync)ed first, so the copy holds every
    /// call answered before this one.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] for a store in memory or on a custom backend
    /// (there is no file to copy), or when `to` exists already (it is never
    /// overwritten: it may be the store file itself); [`Error::Io`] when the
    /// copy cannot be written (the temporary file is removed);
    /// [`Error::Reentrant`] inside a read or write closure of this store.
    pub fn backup(&self, to: impl AsRef<Path>) -> Result<u64> {
        let to = to.as_ref();
        let Some(from) = self.path().map(Path::to_path_buf) else {
            return Err(Error::InvalidInput {
                field: "store",
                reason: "a store in memory or on a custom backend has no file to back up".into(),
            });
        };
        refuse_existing(to)?;
        self.sync()?;
        let temp = temp_beside(to);
        let copied = self
            .engine()
            .inspect_write(|_| copy_synced(&from, &temp).map_err(Error::Io));
        let done = copied.and_then(|len| {
            // Checked again: `to` may have appeared while the copy ran.
            refuse_existing(to)?;
            fs::rename(&temp, to).map_err(Error::Io)?;
            sync_dir(to).map_err(Error::Io)?;
            Ok(len)
        });
        if done.is_err() {
            let _ = fs::remove_file(&temp);
        }
        done
    }
}

fn refuse_existing(to: &Path) -> Result<()> {
    match fs::symlink_metadata(to) {
        Ok(_) => Err(Error::InvalidInput {
            field: "to",
            reason: format!(
                "{} exists; a backup is written to a new file only",
                to.display()
            ),
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::Io(e)),
    }
}

/// `to` with a suffix naming this process, in `to`'s directory (so that the
/// rename stays on one file system).
fn temp_beside(to: &Path) -> PathBuf {
    let mut name = to.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".backup-{}", std::process::id()));
    to.with_file_name(name)
}

/// Copies `from` to the new file `to` and syncs it; its length.
fn copy_synced(from: &Path, to: &Path) -> io::Result<u64> {
    let mut src = File::open(from)?;
    let mut dst = OpenOptions::new().write(true).create_new(true).open(to)?;
    let len = io::copy(&mut src, &mut dst)?;
    dst.sync_all()?;
    Ok(len)
}

/// Syncs the directory holding `path`, so that a rename into it is durable.
fn sync_dir(path: &Path) -> io::Result<()> {
    #[cfg(unix)]
    {
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        File::open(dir)?.sync_all()
    }
    #[cfg(not(unix))]
    {
        let _ = path;
        Ok(())
    }
}
