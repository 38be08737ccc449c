/*
 * The restore guard: preloaded into CRIU when it restores a job of a user other than root, it makes
 * every change CRIU makes to the filesystem by name (create, remove, rename, link, change owner
 * or mode, bind or connect a Unix socket) with the job user's filesystem rights, and every open
 * that meets a link on its way, so a folder the user swaps for a link while CRIU works gains them
 * nothing: the kernel checks each as the user's. The paths CRIU records are those the kernel
 * shows, which hold no link; an open without one stays root's (the job's supervisor runs as root,
 * its program may be in a folder only root may enter), and the daemon then checks that the user
 * may hold what the restored processes hold (checkpoint/reopened.py).
 *
 * CRIU's own work keeps root's rights: a path reached, through folders only root may change, into
 * one of the places named in SING_RESTORE_GUARD_PLACES or a temporary folder CRIU made (named like
 * CRIU's, owned by root); and a file of /proc that is not reached through a process's root,
 * working directory or open files.
 *
 * Environment: LD_PRELOAD (removed once loaded into CRIU, so that the programs CRIU runs do not
 * get the guard), SING_RESTORE_GUARD_UID, _GID, _GROUPS (comma-separated) and _PLACES
 * (colon-separated folders); with SING_RESTORE_GUARD_PROBE set, the guard says on stderr that it
 * is active. It does nothing in a program not named criu (a wrapper script on the way) or
 * without a non-zero UID.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <linux/openat2.h>
#include <sys/statfs.h>
#include <sys/types.h>
#include <sys/un.h>
#include <unistd.h>

#define MAX_GROUPS 256
#define MAX_PLACES 8
#define PROC_SUPER_MAGIC 0x9fa0

static int guard_active;
static uid_t guard_uid;
static gid_t guard_gid;
static gid_t guard_groups[MAX_GROUPS];
static int guard_group_count;
static struct {
	dev_t dev;
	ino_t ino;
} guard_places[MAX_PLACES];
static int guard_place_count;

static const char *const criu_temporary_prefixes[] = {".criu.", "cr-tmpfs.", "crtools-", NULL};

__attribute__((constructor)) static void guard_init(void)
{
	const char *uid = getenv("SING_RESTORE_GUARD_UID");
	const char *gid = getenv("SING_RESTORE_GUARD_GID");
	const char *groups = getenv("SING_RESTORE_GUARD_GROUPS");
	const char *places = getenv("SING_RESTORE_GUARD_PLACES");
	char buffer[PATH_MAX];
	struct stat st;

	if (strncmp(program_invocation_short_name, "criu", 4) != 0)
		return;
	unsetenv("LD_PRELOAD");
	if (!uid || !gid || atol(uid) <= 0)
		return;
	guard_uid = (uid_t)atol(uid);
	guard_gid = (gid_t)atol(gid);
	for (const char *p = groups; p && *p && guard_group_count < MAX_GROUPS;) {
		guard_groups[guard_group_count++] = (gid_t)strtoul(p, NULL, 10);
		p = strchr(p, ',');
		p = p ? p + 1 : NULL;
	}
	for (const char *p = places; p && *p && guard_place_count < MAX_PLACES;) {
		const char *end = strchr(p, ':');
		size_t len = end ? (size_t)(end - p) : strlen(p);
		if (len < sizeof(buffer)) {
			memcpy(buffer, p, len);
			buffer[len] = '\0';
			if (stat(buffer, &st) == 0 && S_ISDIR(st.st_mode)) {
				guard_places[guard_place_count].dev = st.st_dev;
				guard_places[guard_place_count].ino = st.st_ino;
				guard_place_count++;
			}
		}
		p = end ? end + 1 : NULL;
	}
	guard_active = 1;
	if (getenv("SING_RESTORE_GUARD_PROBE"))
		fprintf(stderr, "restore guard: active for uid %u\n", (unsigned)guard_uid);
}

static int is_place(const struct stat *st)
{
	for (int i = 0; i < guard_place_count; i++)
		if (guard_places[i].dev == st->st_dev && guard_places[i].ino == st->st_ino)
			return 1;
	return 0;
}

static int is_criu_temporary(const char *name, const struct stat *st)
{
	if (st->st_uid != 0 || !S_ISDIR(st->st_mode))
		return 0;
	for (int i = 0; criu_temporary_prefixes[i]; i++)
		if (strncmp(name, criu_temporary_prefixes[i], strlen(criu_temporary_prefixes[i])) == 0)
			return 1;
	return 0;
}

/* Whether only root may change the entry `child` (NULL: a name not there) of folder `dir`. */
static int only_root_changes(const struct stat *dir, const struct stat *child)
{
	if (dir->st_uid != 0)
		return 0;
	if ((dir->st_mode & (S_IWGRP | S_IWOTH)) == 0)
		return 1;
	return (dir->st_mode & S_ISVTX) && child && child->st_uid == 0;
}

/*
 * Whether `path` (absolute) names a file of this process's /proc (a proc mount) that leads no
 * further into the filesystem: not through a process's root or working directory, nor beyond the
 * link of an open or mapped file. Those files are CRIU's business (its own processes' state, the
 * job's namespaces, sysctls).
 */
static int proc_ground(const char *path)
{
	static const char *const ways_in[] = {"root", "cwd", NULL};
	static const char *const link_folders[] = {"fd", "map_files", NULL};
	struct statfs fs;
	const char *p = path + strlen("/proc");
	int after_link_folder = 0;

	if (statfs("/proc", &fs) < 0 || fs.f_type != PROC_SUPER_MAGIC)
		return 0;
	while (*p) {
		const char *end;
		size_t len;

		while (*p == '/')
			p++;
		if (!*p)
			break;
		end = strchrnul(p, '/');
		len = (size_t)(end - p);
		if (after_link_folder == 2 || (len == 2 && strncmp(p, "..", 2) == 0))
			return 0; /* beyond /proc/PID/fd/N: into what the link leads to */
		if (after_link_folder == 1)
			after_link_folder = 2;
		for (int i = 0; ways_in[i]; i++)
			if (len == strlen(ways_in[i]) && strncmp(p, ways_in[i], len) == 0 && *end)
				return 0;
		for (int i = 0; link_folders[i]; i++)
			if (len == strlen(link_folders[i]) && strncmp(p, link_folders[i], len) == 0)
				after_link_folder = 1;
		p = end;
	}
	return 1;
}

/*
 * Whether `path` (absolute, no "..") names CRIU's own ground: reached from "/" through folders only
 * root may change, passing through or naming a guarded place or a temporary folder of CRIU's.
 * `follow_last`: the operation follows a link at the end of the path.
 */
static int criu_ground(const char *path, int follow_last)
{
	char name[NAME_MAX + 1];
	struct stat dir_st, child_st;
	int dir = (int)syscall(SYS_openat, AT_FDCWD, "/", O_PATH | O_DIRECTORY | O_CLOEXEC);
	int inside = 0, verdict = 0;
	const char *p = path;

	if (strncmp(path, "/proc/", 6) == 0) {
		if (dir >= 0)
			close(dir);
		return proc_ground(path);
	}
	if (dir < 0)
		return 0;
	if (fstat(dir, &dir_st) < 0)
		goto out;
	inside = is_place(&dir_st);
	for (;;) {
		const char *end;
		size_t len;
		int exists, next;

		while (*p == '/')
			p++;
		if (!*p) {
			verdict = inside;
			goto out;
		}
		end = strchrnul(p, '/');
		len = (size_t)(end - p);
		if (len > NAME_MAX)
			goto out;
		memcpy(name, p, len);
		name[len] = '\0';
		p = end;
		while (*p == '/')
			p++;
		if (strcmp(name, ".") == 0)
			continue;
		if (strcmp(name, "..") == 0)
			goto out;
		exists = fstatat(dir, name, &child_st, AT_SYMLINK_NOFOLLOW) == 0;
		if (!exists && errno != ENOENT)
			goto out;
		if (!only_root_changes(&dir_st, exists ? &child_st : NULL))
			goto out;
		if (!*p) {
			if (exists && S_ISLNK(child_st.st_mode) && follow_last)
				goto out;
			verdict = inside || (exists && is_criu_temporary(name, &child_st));
			goto out;
		}
		if (!exists || !S_ISDIR(child_st.st_mode))
			goto out;
		if (is_criu_temporary(name, &child_st))
			inside = 1;
		next = (int)syscall(SYS_openat, dir, name, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
		if (next < 0)
			goto out;
		close(dir);
		dir = next;
		if (fstat(dir, &dir_st) < 0 || dir_st.st_dev != child_st.st_dev || dir_st.st_ino != child_st.st_ino)
			goto out;
		if (is_place(&dir_st))
			inside = 1;
	}
out:
	close(dir);
	return verdict;
}

/* Whether the change to `path` (relative to `dirfd`) may be made with root's rights. */
static int as_root(int dirfd, const char *path, int follow_last)
{
	char full[PATH_MAX * 2 + 2];
	char base[PATH_MAX];
	char link[64];
	long len;

	if (!guard_active)
		return 1;
	if (!path || !*path)
		return 0;
	if (path[0] == '/')
		return criu_ground(path, follow_last);
	if (dirfd == AT_FDCWD) {
		len = syscall(SYS_getcwd, base, sizeof(base));
		if (len <= 0)
			return 0;
	} else {
		snprintf(link, sizeof(link), "/proc/self/fd/%d", dirfd);
		len = readlink(link, base, sizeof(base) - 1);
		if (len <= 0)
			return 0;
		base[len] = '\0';
	}
	if (base[0] != '/')
		return 0;
	{
		/* The folder must be the one its path names now, else its path says nothing. */
		struct stat held, named;
		if ((dirfd == AT_FDCWD ? stat(".", &held) : fstat(dirfd, &held)) < 0 || stat(base, &named) < 0 ||
		    held.st_dev != named.st_dev || held.st_ino != named.st_ino)
			return 0;
	}
	snprintf(full, sizeof(full), "%s/%s", base, path);
	return criu_ground(full, follow_last);
}

struct saved_rights {
	int fsuid;
	int fsgid;
	int group_count;
	gid_t groups[MAX_GROUPS];
};

/* Take the job user's filesystem rights on this thread; -1 (errno EPERM) if they cannot be taken. */
static int take_user_rights(struct saved_rights *saved)
{
	saved->group_count = (int)syscall(SYS_getgroups, MAX_GROUPS, saved->groups);
	if (saved->group_count < 0)
		goto fail;
	saved->fsgid = (int)syscall(SYS_setfsgid, -1);
	saved->fsuid = (int)syscall(SYS_setfsuid, -1);
	if (syscall(SYS_setgroups, guard_group_count, guard_groups) < 0)
		goto fail;
	syscall(SYS_setfsgid, guard_gid);
	syscall(SYS_setfsuid, guard_uid);
	if ((uid_t)syscall(SYS_setfsuid, -1) == guard_uid && (gid_t)syscall(SYS_setfsgid, -1) == guard_gid)
		return 0;
	syscall(SYS_setfsuid, saved->fsuid);
	syscall(SYS_setfsgid, saved->fsgid);
	syscall(SYS_setgroups, saved->group_count, saved->groups);
fail:
	errno = EPERM;
	return -1;
}

static void give_back_rights(const struct saved_rights *saved)
{
	int error = errno;
	syscall(SYS_setfsuid, saved->fsuid);
	syscall(SYS_setfsgid, saved->fsgid);
	syscall(SYS_setgroups, saved->group_count, saved->groups);
	errno = error;
}

#define REAL(name) ((__typeof__(&name))dlsym(RTLD_NEXT, #name))

/* Run CALL with root's rights when ROOT_OK, else with the job user's. */
#define GUARDED(ROOT_OK, CALL)                                   \
	do {                                                     \
		struct saved_rights saved_;                      \
		__typeof__(CALL) result_;                        \
		if (ROOT_OK)                                     \
			return CALL;                             \
		if (take_user_rights(&saved_) < 0)               \
			return -1;                               \
		result_ = CALL;                                  \
		give_back_rights(&saved_);                       \
		return result_;                                  \
	} while (0)

static int creates(int flags)
{
	return (flags & (O_CREAT | O_TRUNC)) || (flags & O_TMPFILE) == O_TMPFILE;
}

static int follows(int flags)
{
	return !(flags & (O_NOFOLLOW | O_EXCL));
}

static mode_t mode_argument(int flags, va_list args)
{
	return (flags & O_CREAT) || (flags & O_TMPFILE) == O_TMPFILE ? (mode_t)va_arg(args, int) : 0;
}

/*
 * open and openat (open(path) is openat(AT_FDCWD, path)). One that creates is a change (above).
 * One that does not is root's on CRIU's ground, and otherwise root's only along a path without a
 * link (openat2 RESOLVE_NO_SYMLINKS: a link met on the way fails it, race-free), relative to a
 * known folder, not to a working directory CRIU may have changed into through a link; else the
 * user's. So a link swapped in never leads root's open anywhere (a device opened has effects).
 */
static int guarded_openat(int dirfd, const char *path, int flags, mode_t mode)
{
	int (*real)(int, const char *, int, ...) = (int (*)(int, const char *, int, ...))dlsym(RTLD_NEXT, "openat64");
	struct open_how how = {.flags = (unsigned long long)flags, .mode = mode, .resolve = RESOLVE_NO_SYMLINKS};
	struct saved_rights saved;
	int fd;

	if (as_root(dirfd, path, follows(flags)))
		return real(dirfd, path, flags, mode);
	if (!creates(flags) && path && (path[0] == '/' || dirfd != AT_FDCWD)) {
		fd = (int)syscall(SYS_openat2, dirfd, path, &how, sizeof(how));
		if (fd >= 0 || (errno != ELOOP && errno != ENOSYS && errno != EINVAL && errno != E2BIG))
			return fd; /* else a link on the way, or no openat2 here (Linux < 5.6), or its stricter flags */
	}
	if (take_user_rights(&saved) < 0)
		return -1;
	fd = real(dirfd, path, flags, mode);
	give_back_rights(&saved);
	return fd;
}

#define OPEN_WRAPPER(name)                                               \
	int name(const char *path, int flags, ...)                       \
	{                                                                \
		va_list args;                                            \
		mode_t mode;                                             \
		va_start(args, flags);                                   \
		mode = mode_argument(flags, args);                       \
		va_end(args);                                            \
		return guarded_openat(AT_FDCWD, path, flags, mode);      \
	}
#define OPENAT_WRAPPER(name)                                             \
	int name(int dirfd, const char *path, int flags, ...)            \
	{                                                                \
		va_list args;                                            \
		mode_t mode;                                             \
		va_start(args, flags);                                   \
		mode = mode_argument(flags, args);                       \
		va_end(args);                                            \
		return guarded_openat(dirfd, path, flags, mode);         \
	}

OPEN_WRAPPER(open)
OPEN_WRAPPER(open64)
OPENAT_WRAPPER(openat)
OPENAT_WRAPPER(openat64)

int creat(const char *path, mode_t mode)
{
	GUARDED(as_root(AT_FDCWD, path, 1), REAL(creat)(path, mode));
}

int creat64(const char *path, mode_t mode)
{
	GUARDED(as_root(AT_FDCWD, path, 1), REAL(creat64)(path, mode));
}

int mkdir(const char *path, mode_t mode)
{
	GUARDED(as_root(AT_FDCWD, path, 0), REAL(mkdir)(path, mode));
}

int mkdirat(int dirfd, const char *path, mode_t mode)
{
	GUARDED(as_root(dirfd, path, 0), REAL(mkdirat)(dirfd, path, mode));
}

int mknod(const char *path, mode_t mode, dev_t dev)
{
	GUARDED(as_root(AT_FDCWD, path, 0), REAL(mknod)(path, mode, dev));
}

int mknodat(int dirfd, const char *path, mode_t mode, dev_t dev)
{
	GUARDED(as_root(dirfd, path, 0), REAL(mknodat)(dirfd, path, mode, dev));
}

int mkfifo(const char *path, mode_t mode)
{
	GUARDED(as_root(AT_FDCWD, path, 0), REAL(mkfifo)(path, mode));
}

int unlink(const char *path)
{
	GUARDED(as_root(AT_FDCWD, path, 0), REAL(unlink)(path));
}

int unlinkat(int dirfd, const char *path, int flags)
{
	GUARDED(as_root(dirfd, path, 0), REAL(unlinkat)(dirfd, path, flags));
}

int rmdir(const char *path)
{
	GUARDED(as_root(AT_FDCWD, path, 0), REAL(rmdir)(path));
}

int rename(const char *from, const char *to)
{
	GUARDED(as_root(AT_FDCWD, from, 0) && as_root(AT_FDCWD, to, 0), REAL(rename)(from, to));
}

int renameat(int from_dir, const char *from, int to_dir, const char *to)
{
	GUARDED(as_root(from_dir, from, 0) && as_root(to_dir, to, 0), REAL(renameat)(from_dir, from, to_dir, to));
}

int renameat2(int from_dir, const char *from, int to_dir, const char *to, unsigned int flags)
{
	GUARDED(as_root(from_dir, from, 0) && as_root(to_dir, to, 0),
		REAL(renameat2)(from_dir, from, to_dir, to, flags));
}

int link(const char *from, const char *to)
{
	GUARDED(as_root(AT_FDCWD, from, 0) && as_root(AT_FDCWD, to, 0), REAL(link)(from, to));
}

int linkat(int from_dir, const char *from, int to_dir, const char *to, int flags)
{
	int from_root = (flags & AT_EMPTY_PATH) && !*from ? 0 : as_root(from_dir, from, flags & AT_SYMLINK_FOLLOW);
	GUARDED(from_root && as_root(to_dir, to, 0), REAL(linkat)(from_dir, from, to_dir, to, flags));
}

int symlink(const char *target, const char *path)
{
	GUARDED(as_root(AT_FDCWD, path, 0), REAL(symlink)(target, path));
}

int symlinkat(const char *target, int dirfd, const char *path)
{
	GUARDED(as_root(dirfd, path, 0), REAL(symlinkat)(target, dirfd, path));
}

int chmod(const char *path, mode_t mode)
{
	GUARDED(as_root(AT_FDCWD, path, 1), REAL(chmod)(path, mode));
}

int fchmodat(int dirfd, const char *path, mode_t mode, int flags)
{
	GUARDED(as_root(dirfd, path, !(flags & AT_SYMLINK_NOFOLLOW)), REAL(fchmodat)(dirfd, path, mode, flags));
}

int chown(const char *path, uid_t uid, gid_t gid)
{
	GUARDED(as_root(AT_FDCWD, path, 1), REAL(chown)(path, uid, gid));
}

int lchown(const char *path, uid_t uid, gid_t gid)
{
	GUARDED(as_root(AT_FDCWD, path, 0), REAL(lchown)(path, uid, gid));
}

int fchownat(int dirfd, const char *path, uid_t uid, gid_t gid, int flags)
{
	GUARDED(as_root(dirfd, path, !(flags & AT_SYMLINK_NOFOLLOW)), REAL(fchownat)(dirfd, path, uid, gid, flags));
}

/* An open file may have been reached by a path the user swapped: its owner and mode change as the user's. */
int fchown(int fd, uid_t uid, gid_t gid)
{
	GUARDED(!guard_active, REAL(fchown)(fd, uid, gid));
}

int fchmod(int fd, mode_t mode)
{
	GUARDED(!guard_active, REAL(fchmod)(fd, mode));
}

int truncate(const char *path, off_t length)
{
	GUARDED(as_root(AT_FDCWD, path, 1), REAL(truncate)(path, length));
}

/* The path of a Unix socket address, or NULL for other families and abstract names. */
static const char *socket_path(const struct sockaddr *address, socklen_t length, char *path)
{
	const struct sockaddr_un *unix_address = (const struct sockaddr_un *)address;
	size_t size;

	if (!address || length <= offsetof(struct sockaddr_un, sun_path) || address->sa_family != AF_UNIX ||
	    !unix_address->sun_path[0])
		return NULL;
	size = length - offsetof(struct sockaddr_un, sun_path);
	if (size > sizeof(unix_address->sun_path))
		size = sizeof(unix_address->sun_path);
	memcpy(path, unix_address->sun_path, size);
	path[size] = '\0';
	return path;
}

int bind(int fd, const struct sockaddr *address, socklen_t length)
{
	char path[sizeof(((struct sockaddr_un *)0)->sun_path) + 1];
	const char *name = socket_path(address, length, path);
	GUARDED(!name || as_root(AT_FDCWD, name, 0), REAL(bind)(fd, address, length));
}

int connect(int fd, const struct sockaddr *address, socklen_t length)
{
	char path[sizeof(((struct sockaddr_un *)0)->sun_path) + 1];
	const char *name = socket_path(address, length, path);
	GUARDED(!name || as_root(AT_FDCWD, name, 1), REAL(connect)(fd, address, length));
}
