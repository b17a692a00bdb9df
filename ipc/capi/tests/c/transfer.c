/*
 * File transfer through libbelayer, as a C harness would drive it: upload a host tree into a
 * sandbox, download it back, stream tar archives through descriptors, and hostile content
 * (a `..` member, a sandbox symlink at a host canary) that never touches the canary.
 *
 * Usage: transfer <belayerd socket> <busybox rootfs> <scratch dir>. Exit 0 on success; on
 * failure prints the failed check with belayer_last_error() and exits 1.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "belayer.h"
#include "check.h"

static int write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    fputs(text, f);
    return fclose(f);
}

/* Whether the file at `path` holds exactly `text`. */
static int holds(const char *path, const char *text) {
    char buf[256] = {0};
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    return n == strlen(text) && memcmp(buf, text, n) == 0;
}

/* One ustar member `name` holding `data`, then the end of the archive, into `fd`. */
static int write_tar(int fd, const char *name, const char *data) {
    unsigned char h[512] = {0};
    size_t len = strlen(data);
    strncpy((char *)h, name, 100);
    memcpy(h + 100, "0000644", 8);
    memcpy(h + 108, "0000000", 8);
    memcpy(h + 116, "0000000", 8);
    snprintf((char *)h + 124, 12, "%011o", (unsigned)len);
    memcpy(h + 136, "00000000000", 12);
    h[156] = '0';
    memcpy(h + 257, "ustar", 6);
    memcpy(h + 263, "00", 2);
    memset(h + 148, ' ', 8);
    unsigned sum = 0;
    for (int i = 0; i < 512; i++) sum += h[i];
    snprintf((char *)h + 148, 8, "%06o", sum);
    unsigned char body[512] = {0};
    memcpy(body, data, len);
    unsigned char end[1024] = {0};
    if (write(fd, h, 512) != 512 || write(fd, body, 512) != 512 || write(fd, end, 1024) != 1024)
        return -1;
    return lseek(fd, 0, SEEK_SET) == 0 ? 0 : -1;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s <socket> <busybox rootfs> <scratch dir>\n", argv[0]);
        return 2;
    }
    const char *socket = argv[1];
    const char *rootfs = argv[2];
    const char *dir = argv[3];
    BelayerClient client = 0;
    char *id = NULL;
    BelayerExecResult r = {0};
    BelayerTransferResult t;
    char src[512], sub[512], file[512], back[512], canary_dir[512], canary[512], cmd[2048];
    char archive[512];
    int fd = -1;

    snprintf(src, sizeof src, "%s/proj", dir);
    snprintf(sub, sizeof sub, "%s/proj/sub", dir);
    snprintf(file, sizeof file, "%s/proj/sub/f.txt", dir);
    snprintf(back, sizeof back, "%s/back", dir);
    snprintf(canary_dir, sizeof canary_dir, "%s/canary-dir", dir);
    snprintf(canary, sizeof canary, "%s/canary-dir/canary", dir);
    snprintf(archive, sizeof archive, "%s/archive.tar", dir);
    CHECK(mkdir(src, 0755) == 0 && mkdir(sub, 0755) == 0 && mkdir(canary_dir, 0755) == 0);
    CHECK(write_file(file, "from c\n") == 0 && write_file(canary, "untouched") == 0);

    OK(belayer_connect(socket, &client));
    int rc = belayer_image_import(client, "busybox", rootfs);
    CHECK(rc == BELAYER_OK || rc == BELAYER_E_ALREADY_EXISTS);
    OK(belayer_sandbox_create(client, "busybox", "c-transfer", &id));

    /* Upload into an existing directory (under the source's name), then download back as a
     * new name. */
    OK(belayer_upload(client, id, src, "/root", 30000, &t));
    CHECK(t.bytes == 7 && t.files == 3);
    OK(belayer_exec(client, id, "cat /root/proj/sub/f.txt", 30000, &r));
    CHECK(r.stdout_buf.len == 7 && memcmp(r.stdout_buf.data, "from c\n", 7) == 0);
    belayer_exec_result_free(&r);
    OK(belayer_download(client, id, "/root/proj", back, 0, &t));
    snprintf(cmd, sizeof cmd, "%s/sub/f.txt", back);
    CHECK(holds(cmd, "from c\n"));
    OK(belayer_upload(client, id, file, "/root/renamed.txt", 0, NULL));

    /* A sandbox symlink at the host canary, then a file in its place: the download replaces
     * the host link and never writes through it. */
    snprintf(cmd, sizeof cmd, "mkdir /root/evil && ln -s %s /root/evil/canary", canary);
    OK(belayer_exec(client, id, cmd, 30000, &r));
    CHECK(r.exit_code == 0);
    belayer_exec_result_free(&r);
    OK(belayer_download(client, id, "/root/evil", dir, 0, &t));
    OK(belayer_exec(client, id, "rm /root/evil/canary && echo pwned > /root/evil/canary", 30000, &r));
    belayer_exec_result_free(&r);
    /* Into the existing directory again: dir/evil is replaced member by member. */
    OK(belayer_download(client, id, "/root/evil", dir, 0, &t));
    snprintf(cmd, sizeof cmd, "%s/evil/canary", dir);
    CHECK(holds(cmd, "pwned\n"));
    CHECK(holds(canary, "untouched"));

    /* Archives on descriptors: a good one, a `..` member (refused), and the download's tar. */
    fd = open(archive, O_RDWR | O_CREAT | O_TRUNC, 0600);
    CHECK(fd >= 0 && write_tar(fd, "fromfd.txt", "fd\n") == 0);
    OK(belayer_upload_archive(client, id, fd, "/root", 0, &t));
    CHECK(t.files == 1 && t.bytes == 3);
    close(fd);
    fd = open(archive, O_RDWR | O_CREAT | O_TRUNC, 0600);
    snprintf(cmd, sizeof cmd, "../../../../../..%s", canary);
    CHECK(fd >= 0 && write_tar(fd, cmd, "pwned") == 0);
    CHECK(belayer_upload_archive(client, id, fd, "/root", 0, &t) == BELAYER_E_TRANSFER_FAILED);
    CHECK(strstr(belayer_last_error(), "..") != NULL);
    close(fd);
    CHECK(holds(canary, "untouched"));
    fd = open(archive, O_RDWR | O_CREAT | O_TRUNC, 0600);
    CHECK(fd >= 0);
    OK(belayer_download_archive(client, id, "/root/fromfd.txt", fd, 0, &t));
    CHECK(lseek(fd, 0, SEEK_END) >= 1024 && t.files == 1);
    close(fd);
    fd = -1;

    /* Errors. */
    CHECK(belayer_upload(client, NULL, src, "/root", 0, &t) == BELAYER_E_INVALID_ARGUMENT);
    CHECK(belayer_download(client, id, "/root", NULL, 0, &t) == BELAYER_E_INVALID_ARGUMENT);
    CHECK(belayer_upload_archive(client, id, -1, "/root", 0, &t) == BELAYER_E_INVALID_ARGUMENT);
    CHECK(belayer_upload(client, "no-such-sandbox", src, "/root", 0, &t) ==
          BELAYER_E_UNKNOWN_SANDBOX);
    CHECK(belayer_upload(client, id, "/no/such/source", "/root", 0, &t) == BELAYER_E_NOT_FOUND);
    CHECK(t.files == 0 && t.bytes == 0);
    CHECK(belayer_upload(client, id, src, "/no/such/parent/x", 0, &t) == BELAYER_E_NOT_FOUND);
    CHECK(belayer_download(client, id, "/root/missing", back, 0, &t) == BELAYER_E_NOT_FOUND);
    CHECK(strcmp(belayer_status_name(BELAYER_E_NO_SPACE), "BELAYER_E_NO_SPACE") == 0);
    /* The connection is still in step after the failed transfers. */
    OK(belayer_ping(client, NULL));

    OK(belayer_sandbox_destroy(client, id));
    printf("transfer ok\n");
out:
    if (fd >= 0) close(fd);
    belayer_string_free(&id);
    if (client) belayer_close(client);
    return failures ? 1 : 0;
}
