//! The tier's directory and files, opened so that no other local user can read them or redirect
//! them: `index.redb` holds every cached block's token ids (what clients asked), and the directory
//! may sit in a shared place such as `/tmp`.
//!
//! - The directory is created `0700`. An existing one must be a directory (not a symbolic link),
//!   owned by the current user and writable by neither group nor others, or the tier is refused:
//!   whoever can write it could plant or swap its files. Its mode is otherwise left as it is (the
//!   user may have chosen a directory they share on purpose); the files are what is kept private.
//!   Once it is checked, no other user can add, replace or rename an entry of it.
//! - Files are opened with `O_NOFOLLOW` (a planted link is refused, never followed to overwrite its
//!   target), must be regular files, are created `0600`, and an existing one is set to `0600`
//!   (versions before issue 23 created them `0644`).
//! - The capacity is refused past the size of the file system that will hold the directory: such
//!   a tier can never fill (`--kv-disk-bytes 1000T` is a typo), and its slot table alone could
//!   exhaust memory.

use std::ffi::CString;
use std::fs::{DirBuilder, File, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::{DiskError, DiskResult};

/// Mode of the directory the tier creates.
const DIR_MODE: u32 = 0o700;
/// Mode of the tier's files.
const FILE_MODE: u32 = 0o600;

/// Refuses an empty path (an unset variable would otherwise mean the current directory) and a
/// capacity larger than the file system holding `dir` (looked up on `dir`'s nearest existing
/// ancestor: nothing is created).
pub fn check_args(dir: &Path, capacity_bytes: u64) -> DiskResult<()> {
    if dir.as_os_str().is_empty() {
        return Err(DiskError::InvalidArgument(
            "the disk tier's directory is an empty path (an unset variable?)".into(),
        ));
    }
    let existing = dir
        .ancestors()
        .map(|a| {
            if a.as_os_str().is_empty() {
                Path::new(".")
            } else {
                a
            }
        })
        .find(|a| a.exists())
        .unwrap_or(Path::new("."));
    let size = file_system_size(existing)?;
    if capacity_bytes > size {
        return Err(DiskError::InvalidArgument(format!(
            "a disk tier of {capacity_bytes} bytes exceeds the {size} bytes of the file system \
             holding {}",
            dir.display()
        )));
    }
    Ok(())
}

/// Total bytes of the file system holding `path` (`statvfs`).
fn file_system_size(path: &Path) -> DiskResult<u64> {
    let name = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| DiskError::InvalidArgument(format!("{} holds a NUL byte", path.display())))?;
    // SAFETY: `name` is a NUL-terminated string and `stat` a writable statvfs, both live for the
    // call; statvfs writes nothing else.
    let stat = unsafe {
        let mut stat: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(name.as_ptr(), &mut stat) != 0 {
            return Err(io::Error::last_os_error().into());
        }
        stat
    };
    Ok((stat.f_blocks as u64).saturating_mul(stat.f_frsize as u64))
}

/// Creates `dir` (`0700`; missing parents as usual) or checks the existing one, as the module doc
/// says.
pub fn prepare_dir(dir: &Path) -> DiskResult<()> {
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    match DirBuilder::new().mode(DIR_MODE).create(dir) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(e.into()),
        _ => {}
    }
    // Without its trailing slash or `.`: `lstat("link/")` would follow the link.
    let bare: PathBuf = dir.components().collect();
    let meta = std::fs::symlink_metadata(&bare)?;
    let refuse = |why: &str| {
        Err(DiskError::Io(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("refusing the disk tier directory {}: {why}", dir.display()),
        )))
    };
    if meta.file_type().is_symlink() {
        return refuse("it is a symbolic link");
    }
    if !meta.is_dir() {
        return refuse("it is not a directory");
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return refuse(&format!(
            "it is owned by uid {}, not this user ({me})",
            meta.uid()
        ));
    }
    if meta.mode() & 0o022 != 0 {
        return refuse(&format!(
            "other users can write it (mode {:o}; chmod go-w)",
            meta.mode() & 0o7777
        ));
    }
    Ok(())
}

/// Opens (or creates) the regular file `path` for reading and writing, not following a symbolic
/// link, mode `0600`.
pub fn open_private(path: &Path) -> DiskResult<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(FILE_MODE)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("refusing {}: it is a symbolic link", path.display()),
            ),
            _ => e,
        })?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(DiskError::Io(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("refusing {}: it is not a regular file", path.display()),
        )));
    }
    if meta.mode() & 0o7777 != FILE_MODE {
        file.set_permissions(std::fs::Permissions::from_mode(FILE_MODE))?;
    }
    Ok(file)
}
