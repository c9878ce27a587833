package io.shardsink.hadoop;

import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.attribute.PosixFilePermission;
import java.util.EnumSet;
import java.util.Set;

import org.apache.hadoop.fs.LocalFileSystem;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.RawLocalFileSystem;
import org.apache.hadoop.fs.permission.FsPermission;

/**
 * Hadoop's local file system (checksummed, as {@link LocalFileSystem}) that sets permissions
 * through java.nio instead of a child process.
 *
 * <p>Without Hadoop's native library (the pyspark wheel ships none), {@link RawLocalFileSystem}
 * sets the permissions of every file it creates by running {@code chmod}: a fork and exec of the
 * JVM's process for each file and for its checksum file. A streaming query writes two
 * checkpoint files per micro-batch (its offset and commit logs), so every micro-batch of every
 * query paid about 8 ms and several milliseconds of CPU for child processes. {@link
 * Files#setPosixFilePermissions} does the same in-process. Everything else is Hadoop's.
 */
public class NioLocalFileSystem extends LocalFileSystem {

  public NioLocalFileSystem() {
    super(new Raw());
  }

  /** {@link RawLocalFileSystem} with {@link #setPermission} through java.nio. */
  public static class Raw extends RawLocalFileSystem {
    private static final PosixFilePermission[] BITS = {
      PosixFilePermission.OTHERS_EXECUTE, PosixFilePermission.OTHERS_WRITE, PosixFilePermission.OTHERS_READ,
      PosixFilePermission.GROUP_EXECUTE, PosixFilePermission.GROUP_WRITE, PosixFilePermission.GROUP_READ,
      PosixFilePermission.OWNER_EXECUTE, PosixFilePermission.OWNER_WRITE, PosixFilePermission.OWNER_READ,
    };

    /** The nine permission bits of {@code mode} (set-uid, set-gid and sticky bits are not kept). */
    static Set<PosixFilePermission> posix(short mode) {
      Set<PosixFilePermission> out = EnumSet.noneOf(PosixFilePermission.class);
      for (int i = 0; i < BITS.length; i++) {
        if ((mode & (1 << i)) != 0) {
          out.add(BITS[i]);
        }
      }
      return out;
    }

    @Override
    public void setPermission(Path p, FsPermission permission) throws IOException {
      Files.setPosixFilePermissions(pathToFile(p).toPath(), posix(permission.toShort()));
    }
  }
}
