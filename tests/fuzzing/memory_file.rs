//! A store file kept in memory: it outlives the store, so dropping the store
//! and opening it again is a reopen of the same file, and a file's bytes can
//! be copied to start many runs from one prepared state, all without the file
//! system's costs.

use std::io;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use idemstore::redb::{BackendError, StorageBackend};

/// The file's bytes, shared by every clone.
#[derive(Debug, Clone, Default)]
pub(crate) struct MemoryFile(Arc<Mutex<Vec<u8>>>);

impl MemoryFile {
    /// A file holding a copy of `bytes`.
    pub(crate) fn from_bytes(bytes: &[u8]) -> MemoryFile {
        MemoryFile(Arc::new(Mutex::new(bytes.to_vec())))
    }

    /// The file's bytes now.
    pub(crate) fn bytes(&self) -> MutexGuard<'_, Vec<u8>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl StorageBackend for MemoryFile {
    fn len(&self) -> Result<u64, BackendError> {
        Ok(self.bytes().len() as u64)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), BackendError> {
        let bytes = self.bytes();
        let start = usize::try_from(offset).map_err(io::Error::other)?;
        let src = bytes
            .get(start..start + out.len())
            .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end"))?;
        out.copy_from_slice(src);
        Ok(())
    }

    fn set_len(&self, len: u64) -> Result<(), BackendError> {
        let len = usize::try_from(len).map_err(io::Error::other)?;
        self.bytes().resize(len, 0);
        Ok(())
    }

    fn sync_data(&self) -> Result<(), BackendError> {
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        let mut bytes = self.bytes();
        let start = usize::try_from(offset).map_err(io::Error::other)?;
        if bytes.len() < start + data.len() {
            bytes.resize(start + data.len(), 0);
        }
        bytes[start..start + data.len()].copy_from_slice(data);
        Ok(())
    }

    fn close(&self) -> Result<(), BackendError> {
        Ok(())
    }
}
