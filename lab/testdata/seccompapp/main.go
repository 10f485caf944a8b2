// seccompapp is a static Go program for the seccomp agent's lab test: it
// runs without the shim (no libc to preload into), as a Go server in an
// unmodified image does.
//
//	seccompapp serve ADDR FILE    HTTP server of FILE at /blob on ADDR (tcp4)
//	seccompapp get URL            prints the body's sha256 and length
//	seccompapp loop ADDR N [MS]   N sequential connections (write 1 byte,
//	                              read it back), MS ms apart: prints the
//	                              slowest in ms
//	seccompapp echo ADDR          echo server (tcp4), for loop
//	seccompapp hold ADDR          one connection, a byte echoed every 50 ms:
//	                              prints "connected", then "err ..." when
//	                              it breaks
package main

import (
	"crypto/sha256"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"time"
)

func main() {
	if len(os.Args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: seccompapp serve ADDR FILE | get URL | loop ADDR N | echo ADDR")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "serve":
		err = serve(os.Args[2], os.Args[3])
	case "get":
		err = get(os.Args[2])
	case "loop":
		n, _ := strconv.Atoi(os.Args[3])
		var pause int
		if len(os.Args) > 4 {
			pause, _ = strconv.Atoi(os.Args[4])
		}
		err = loop(os.Args[2], n, time.Duration(pause)*time.Millisecond)
	case "echo":
		err = echo(os.Args[2])
	case "hold":
		err = hold(os.Args[2])
	default:
		err = fmt.Errorf("unknown command %s", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "seccompapp:", err)
		os.Exit(1)
	}
}

func serve(addr, file string) error {
	ln, err := net.Listen("tcp4", addr)
	if err != nil {
		return err
	}
	fmt.Println("listening", ln.Addr())
	http.HandleFunc("/blob", func(w http.ResponseWriter, r *http.Request) { http.ServeFile(w, r, file) })
	return http.Serve(ln, nil)
}

func get(url string) error {
	c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{Proxy: nil}}
	resp, err := c.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	h := sha256.New()
	n, err := io.Copy(h, resp.Body)
	if err != nil {
		return err
	}
	fmt.Printf("%x %d\n", h.Sum(nil), n)
	return nil
}

func echo(addr string) error {
	ln, err := net.Listen("tcp4", addr)
	if err != nil {
		return err
	}
	fmt.Println("listening", ln.Addr())
	for {
		c, err := ln.Accept()
		if err != nil {
			return err
		}
		go func() {
			io.Copy(c, c)
			c.Close()
		}()
	}
}

func loop(addr string, n int, pause time.Duration) error {
	var slowest time.Duration
	buf := []byte{0}
	for i := 0; i < n; i++ {
		t := time.Now()
		c, err := net.DialTimeout("tcp4", addr, 5*time.Second)
		if err != nil {
			return fmt.Errorf("connection %d: %w", i, err)
		}
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write(buf); err == nil {
			_, err = io.ReadFull(c, buf)
		}
		c.Close()
		if err != nil {
			return fmt.Errorf("connection %d: %w", i, err)
		}
		slowest = max(slowest, time.Since(t))
		time.Sleep(pause)
	}
	fmt.Printf("ok %d slowest_ms %.1f\n", n, float64(slowest.Microseconds())/1000)
	return nil
}

func hold(addr string) error {
	c, err := net.DialTimeout("tcp4", addr, 5*time.Second)
	if err != nil {
		return err
	}
	fmt.Println("connected", c.LocalAddr(), c.RemoteAddr())
	buf := []byte{0}
	for {
		c.SetDeadline(time.Now().Add(5 * time.Second))
		_, err := c.Write(buf)
		if err == nil {
			_, err = io.ReadFull(c, buf)
		}
		if err != nil {
			fmt.Println("err", err)
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
}
